//! Real DHCP clients against siteboot's full DHCP server: busybox udhcpc and ISC dhclient get,
//! renew and release leases; a reservation gives its address; perfdhcp runs a short burst.
//! Each client is its own namespace on a veth into the server's bridge.
//!
//! Failures panic (`unwrap`) while the processes are alive, so their logs get printed.

use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::json;
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::clients::{self, ClientHost, Dhclient, Dnsmasq, ForgedRelay, Lease, Udhcpc};
use siteboot_tests::netns::Netns;

const LEASE_TIMEOUT: Duration = Duration::from_secs(30);
/// Distinct from siteboot's default, so the test sees the configured value arrive.
const LEASE_SECS: u64 = 600;
const RESERVED_MAC: &str = "52:54:00:00:02:10";
const RESERVED: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 10);
const RELEASES: &str = r#"siteboot_dhcp_messages_total{direction="received",type="release"}"#;
/// The trusted relay, sending from its giaddr (as perfdhcp does).
const RELAY: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 250);
/// A trusted relay that sends from another address than its giaddr.
const RELAY_GIADDR: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 240);
const RELAY_SOURCE: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 241);
const UNTRUSTED_RELAYS: &str = r#"siteboot_dhcp_relayed_dropped_total{reason="untrusted-relay"}"#;
const FORGED_SOURCES: &str = r#"siteboot_dhcp_relayed_dropped_total{reason="unexpected-source"}"#;
const PIN_MISMATCHES: &str =
    r#"siteboot_dhcp_relayed_dropped_total{reason="relay-agent-mismatch"}"#;

/// siteboot in full mode on a fresh lab network, with a 10 minute lease and one reservation.
fn siteboot(tag: &str) -> (Netns, Appliance) {
    siteboot_with(tag, |_| {})
}

/// [`siteboot`], its config changed by `adjust` first.
fn siteboot_with(tag: &str, adjust: impl FnOnce(&mut serde_json::Value)) -> (Netns, Appliance) {
    let ns = appliance::lab_network(tag).unwrap();
    let mut config = appliance::lab_config("full");
    config["dhcp"]["lease_time"] = json!("10m");
    config["dhcp"]["reservations"] =
        json!([{ "mac": RESERVED_MAC, "address": RESERVED.to_string() }]);
    // perfdhcp acts as a relay from this address.
    config["dhcp"]["trusted_relays"] = json!([
        RELAY.to_string(),
        { "giaddr": RELAY_GIADDR.to_string(), "sources": [RELAY_SOURCE.to_string()] },
    ]);
    adjust(&mut config);
    let siteboot = Appliance::start(&ns, config).unwrap();
    (ns, siteboot)
}

fn in_pool(address: Ipv4Addr) -> bool {
    (Ipv4Addr::new(10, 99, 0, 100)..=Ipv4Addr::new(10, 99, 0, 199)).contains(&address)
}

/// The lease carries what `lab_config` configures.
fn assert_configured(lease: &Lease) {
    let gateway = appliance::ADDRESS.parse::<Ipv4Addr>().unwrap();
    assert_eq!(lease.prefix_len, Some(24), "{lease:?}");
    assert_eq!(lease.routers, [gateway], "{lease:?}");
    assert_eq!(lease.dns, [gateway], "{lease:?}");
    assert_eq!(lease.server, Some(gateway), "{lease:?}");
    assert_eq!(lease.domain.as_deref(), Some("lab.internal"), "{lease:?}");
    assert_eq!(lease.lease_secs, Some(LEASE_SECS), "{lease:?}");
}

/// A new client (udhcpc `-r`) asks for `address`; returns what it got.
fn ask_for(server: &Netns, mac: &str, address: Ipv4Addr) -> Ipv4Addr {
    let host = ClientHost::attach(server, appliance::BRIDGE, mac).unwrap();
    let mut client = Udhcpc::start(&host, &["-r", &address.to_string()]).unwrap();
    client.wait_bound(LEASE_TIMEOUT).unwrap().address.expect("lease without address")
}

#[test]
fn udhcpc_gets_renews_and_releases_a_lease() {
    let (ns, siteboot) = siteboot("udhcpc");
    let before = siteboot.metrics().unwrap();

    let host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:01").unwrap();
    let mut client = Udhcpc::start(&host, &[]).unwrap();
    let lease = client.wait_bound(LEASE_TIMEOUT).unwrap();
    let address = lease.address.expect("lease without address");
    assert!(in_pool(address), "{address} is outside the pool");
    assert_configured(&lease);

    let renewed = client.renew(LEASE_TIMEOUT).unwrap();
    assert_eq!(renewed.address, Some(address), "renewal changed the address: {renewed:?}");
    assert_eq!(renewed.lease_secs, Some(LEASE_SECS), "{renewed:?}");

    // While the lease is held, another client asking for its address gets a different one.
    let other = ask_for(&ns, "52:54:00:00:02:02", address);
    assert_ne!(other, address, "one address leased to two clients");
    assert!(in_pool(other), "{other} is outside the pool");

    // After the release, the address is free again.
    client.release(LEASE_TIMEOUT).unwrap();
    let reused = ask_for(&ns, "52:54:00:00:02:03", address);
    assert_eq!(reused, address, "the released address was not given out again");

    let after = siteboot.metrics().unwrap();
    assert!(after.counters("dhcp") > before.counters("dhcp"), "DHCP counters did not move");
    assert!(after.get(RELEASES) > before.get(RELEASES), "the RELEASE was not counted");
}

#[test]
fn dhclient_gets_renews_and_releases_a_lease() {
    let (ns, siteboot) = siteboot("dhclient");
    let before = siteboot.metrics().unwrap();

    let host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:04").unwrap();
    let mut client = Dhclient::new(&host).unwrap();
    let lease = client.obtain(LEASE_TIMEOUT).unwrap();
    assert_eq!(lease.event, "BOUND", "{lease:?}");
    let address = lease.address.expect("lease without address");
    assert!(in_pool(address), "{address} is outside the pool");
    assert_configured(&lease);

    // A second run of dhclient (INIT-REBOOT from its lease file) keeps the address.
    client.stop(LEASE_TIMEOUT).unwrap();
    let renewed = client.obtain(LEASE_TIMEOUT).unwrap();
    assert_eq!(renewed.event, "REBOOT", "{renewed:?}");
    assert_eq!(renewed.address, Some(address), "renewal changed the address: {renewed:?}");
    assert_eq!(renewed.lease_secs, Some(LEASE_SECS), "{renewed:?}");

    let other = ask_for(&ns, "52:54:00:00:02:05", address);
    assert_ne!(other, address, "one address leased to two clients");

    client.release(LEASE_TIMEOUT).unwrap();
    let events = client.events();
    assert!(events.iter().any(|e| e.event == "RELEASE"), "no RELEASE event: {events:?}");
    let reused = ask_for(&ns, "52:54:00:00:02:06", address);
    assert_eq!(reused, address, "the released address was not given out again");
    let after = siteboot.metrics().unwrap();
    assert!(after.get(RELEASES) > before.get(RELEASES), "the RELEASE was not counted");
}

#[test]
fn reservation_gives_the_reserved_address() {
    let (ns, _siteboot) = siteboot("reserve");
    // Even when the client asks for a pool address, the reservation wins.
    let got = ask_for(&ns, RESERVED_MAC, Ipv4Addr::new(10, 99, 0, 150));
    assert_eq!(got, RESERVED);

    let host = ClientHost::attach(&ns, appliance::BRIDGE, RESERVED_MAC).unwrap();
    let lease = Dhclient::new(&host).unwrap().obtain(LEASE_TIMEOUT).unwrap();
    assert_eq!(lease.address, Some(RESERVED), "{lease:?}");
    assert_configured(&lease);

    // Nobody else gets the reserved address, even when asking for it.
    assert_ne!(ask_for(&ns, "52:54:00:00:02:11", RESERVED), RESERVED);
}

#[test]
fn perfdhcp_burst_is_answered() {
    let (ns, siteboot) = siteboot("perf");
    let host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:20").unwrap();
    // 50 exchanges/s for 5 s over 50 simulated clients (perfdhcp acts as a relay from .250).
    let report = clients::perfdhcp(&host, "10.99.0.250/24", 50, 50, 5).unwrap();
    for name in ["DISCOVER-OFFER", "REQUEST-ACK"] {
        let exchange = report.exchange(name).unwrap_or_else(|| panic!("{}", report.output));
        let context = format!("{name}: {exchange:?}\n{}", report.output);
        assert!(exchange.sent >= 100, "{context}");
        // A few drops at the very end of the run are perfdhcp timing, not the server.
        assert!(exchange.drops <= 2 + exchange.sent / 100, "{context}");
        assert_eq!(exchange.rejected_leases, 0, "{context}");
    }
    assert!(siteboot.exited().is_none(), "siteboot exited during the burst");
}

/// A machine on the segment (10.99.0.77) puts the trusted relay's address in `giaddr` and
/// holds that address too, to read the answer: on the code before the fix it was answered
/// (the datagram's source was never checked). A relay siteboot does not trust was dropped with
/// a debug line only; now once per relay at warn, and counted.
#[test]
fn relayed_messages_are_answered_only_from_the_trusted_relay_s_source() {
    let (ns, siteboot) = siteboot("relaysrc");
    let server = appliance::ADDRESS.parse().unwrap();
    let attacker = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:40").unwrap();
    let forger = ForgedRelay::open(
        &attacker.ns,
        ClientHost::IFACE,
        Ipv4Addr::new(10, 99, 0, 77),
        RELAY,
        server,
    )
    .unwrap();
    for _ in 0..3 {
        let offer = forger.discover("52:54:00:00:02:41", None).unwrap();
        assert!(offer.is_none(), "answered a trusted giaddr from another source: {offer:?}");
    }

    let untrusted = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:42").unwrap();
    let untrusted_relay = Ipv4Addr::new(10, 99, 0, 251);
    let relay = ForgedRelay::open(
        &untrusted.ns,
        ClientHost::IFACE,
        untrusted_relay,
        untrusted_relay,
        server,
    )
    .unwrap();
    for _ in 0..3 {
        assert!(relay.discover("52:54:00:00:02:43", None).unwrap().is_none());
    }
    let metrics = siteboot.metrics().unwrap();
    assert_eq!(
        (metrics.get(FORGED_SOURCES), metrics.get(UNTRUSTED_RELAYS)),
        (3.0, 3.0),
        "each dropped datagram counted"
    );
    let log = siteboot.log();
    assert_eq!(log.matches("a relay not in dhcp.trusted_relays").count(), 1, "{log}");
    assert_eq!(log.matches("does not list for it").count(), 1, "{log}");

    // A relay listed with the source it sends from is answered, with its option 82 echoed.
    let relay_host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:44").unwrap();
    let relay =
        ForgedRelay::open(&relay_host.ns, ClientHost::IFACE, RELAY_SOURCE, RELAY_GIADDR, server)
            .unwrap();
    let circuit_id = [&[1, 6][..], b"eth1/7"].concat();
    let offer = relay.discover("52:54:00:00:02:45", Some(&circuit_id)).unwrap();
    let offer = offer.expect("no OFFER through the relay's own source");
    assert!(in_pool(offer.yiaddr()), "{offer:?}");
    use dhcproto::v4::{DhcpOption, OptionCode, relay};
    let circuit = match offer.opts().get(OptionCode::RelayAgentInformation) {
        Some(DhcpOption::RelayAgentInformation(info)) => info.get(relay::RelayCode::AgentCircuitId),
        _ => None,
    };
    assert_eq!(
        circuit,
        Some(&relay::RelayInfo::AgentCircuitId(b"eth1/7".to_vec())),
        "option 82 not echoed: {offer:?}"
    );
}

/// Option 82 holding one circuit-id sub-option: what a relay adds for a client on `port`.
fn circuit_id(port: &[u8]) -> Vec<u8> {
    [&[1, u8::try_from(port.len()).unwrap()][..], port].concat()
}

/// A host is pinned to port `eth1/0/12` of the trusted relay. A machine on another port of that
/// relay (`eth1/0/13`, which the relay says in option 82) forges the host's MAC: on the code
/// before the fix it got the host's OFFER (option 82 was only echoed), and so did a DISCOVER
/// the relay passed on with no option 82. Now neither is answered; each is counted, the MAC is
/// logged once, and the host is answered through its own port. A MAC with no pin is answered
/// through any port, as before.
#[test]
fn a_pinned_host_is_answered_only_through_its_relay_port() {
    const PINNED: &str = "52:54:00:00:02:50";
    let (ns, siteboot) = siteboot_with("relaypin", |config| {
        config["hosts"] = json!([{
            "mac": PINNED,
            "profile": appliance::LAB_PROFILE,
            "relay_agent": { "circuit_id": "eth1/0/12" },
        }]);
    });
    let server = appliance::ADDRESS.parse().unwrap();
    let relay_host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:51").unwrap();
    let relay =
        ForgedRelay::open(&relay_host.ns, ClientHost::IFACE, RELAY_SOURCE, RELAY_GIADDR, server)
            .unwrap();
    let other_port = circuit_id(b"eth1/0/13");
    // The pinned port's name as a remote-id, not a circuit-id.
    let remote_id = [&[2, 9][..], b"eth1/0/12"].concat();
    for _ in 0..3 {
        let offer = relay.discover(PINNED, Some(&other_port)).unwrap();
        assert!(offer.is_none(), "answered the pinned MAC through another port: {offer:?}");
        let offer = relay.discover(PINNED, None).unwrap();
        assert!(offer.is_none(), "answered the pinned MAC relayed with no option 82: {offer:?}");
        let offer = relay.discover(PINNED, Some(&remote_id)).unwrap();
        assert!(offer.is_none(), "answered the pinned MAC for a remote-id: {offer:?}");
    }
    let metrics = siteboot.metrics().unwrap();
    assert_eq!(metrics.get(PIN_MISMATCHES), 9.0, "each dropped DISCOVER counted");
    let log = siteboot.log();
    assert_eq!(log.matches("the host is pinned to").count(), 1, "logged once per MAC: {log}");
    assert!(log.contains("circuit-id eth1/0/13"), "the log says what the relay said: {log}");

    let unpinned = relay.discover("52:54:00:00:02:52", Some(&other_port)).unwrap();
    assert!(unpinned.is_some_and(|o| in_pool(o.yiaddr())), "a MAC with no pin, any port");
    let own_port = [circuit_id(b"eth1/0/12"), remote_id].concat();
    let offer = relay.discover(PINNED, Some(&own_port)).unwrap();
    let offer = offer.expect("no OFFER through the pinned port");
    assert!(in_pool(offer.yiaddr()), "{offer:?}");
    assert_eq!(siteboot.metrics().unwrap().get(PIN_MISMATCHES), 9.0);
}

/// Checks the client helpers themselves against dnsmasq (no siteboot): if this fails, the
/// harness is broken, not siteboot.
#[test]
fn lab_reference_clients_against_dnsmasq() {
    let ns = appliance::lab_network("refcli").unwrap();
    let dnsmasq = Dnsmasq::start(
        &ns,
        appliance::BRIDGE,
        &[
            "--dhcp-range=10.99.0.100,10.99.0.199,255.255.255.0,10m".into(),
            "--dhcp-option=option:router,10.99.0.1".into(),
            "--dhcp-option=option:dns-server,10.99.0.1".into(),
            "--domain=lab.internal".into(),
            "--dhcp-authoritative".into(),
        ],
    )
    .unwrap();

    let host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:31").unwrap();
    let mut udhcpc = Udhcpc::start(&host, &[]).unwrap();
    let lease = udhcpc.wait_bound(LEASE_TIMEOUT).unwrap();
    assert_configured(&lease);
    let address = lease.address.unwrap();
    assert_eq!(udhcpc.renew(LEASE_TIMEOUT).unwrap().address, Some(address));
    assert_ne!(ask_for(&ns, "52:54:00:00:02:32", address), address);
    udhcpc.release(LEASE_TIMEOUT).unwrap();
    assert_eq!(ask_for(&ns, "52:54:00:00:02:33", address), address);

    let mac = "52:54:00:00:02:34";
    let host = ClientHost::attach(&ns, appliance::BRIDGE, mac).unwrap();
    let mut dhclient = Dhclient::new(&host).unwrap();
    let lease = dhclient.obtain(LEASE_TIMEOUT).unwrap();
    assert_eq!(lease.event, "BOUND");
    assert_configured(&lease);
    dhclient.stop(LEASE_TIMEOUT).unwrap();
    let renewed = dhclient.obtain(LEASE_TIMEOUT).unwrap();
    assert_eq!((renewed.event.as_str(), renewed.address), ("REBOOT", lease.address));
    dhclient.release(LEASE_TIMEOUT).unwrap();
    // dnsmasq drops a released lease from its lease file.
    siteboot_tests::wait::for_("dnsmasq to drop the released lease", LEASE_TIMEOUT, || {
        (!dnsmasq.leases().contains(mac)).then_some(())
    })
    .unwrap();

    let host = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:02:35").unwrap();
    let report = clients::perfdhcp(&host, "10.99.0.250/24", 20, 20, 3).unwrap();
    let exchange = report.exchange("REQUEST-ACK").unwrap_or_else(|| panic!("{}", report.output));
    assert!(exchange.sent >= 40 && exchange.received > 0, "{}", report.output);
}
