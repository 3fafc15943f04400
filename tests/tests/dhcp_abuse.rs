//! DECLINE and RELEASE abuse over the wire (issue 22, item 10), against siteboot's full DHCP
//! server with `known_hosts_only`: a machine on the segment that forges only `chaddr` (its
//! Ethernet and IP sources are its own) tries to empty the pool with REQUEST + DECLINE cycles
//! as a known MAC, and to take a known host's address with a forged RELEASE or DECLINE.
//! The unit tests in `boot/src/dhcp/server.rs` perform the same attacks in the sans-IO core.
//!
//! Failures panic (`unwrap`) while the processes are alive, so their logs get printed.

use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::json;
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::clients::{ClientHost, ForgedDhcp, ThreadDhcp, Udhcpc};
use siteboot_tests::netns::Netns;

const LEASE_TIMEOUT: Duration = Duration::from_secs(30);
/// Every MAC here is one of the site's hosts: `known_hosts_only` answers no other.
const ATTACKER_MAC: &str = "52:54:00:00:03:01";
const VICTIM_MAC: &str = "52:54:00:00:03:02";
const NEWCOMER_MAC: &str = "52:54:00:00:03:03";
const THIEF_MAC: &str = "52:54:00:00:03:04";
const DECLINES_IGNORED: &str = "siteboot_dhcp_declines_ignored_total";
const RELEASES_IGNORED: &str = "siteboot_dhcp_releases_ignored_total";
const RELEASES: &str = r#"siteboot_dhcp_messages_total{direction="received",type="release"}"#;
const DECLINES: &str = r#"siteboot_dhcp_messages_total{direction="received",type="decline"}"#;
/// The pool: 20 addresses, so a run through it takes seconds.
const POOL_FIRST: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 100);
const POOL_LAST: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 119);

fn server_address() -> Ipv4Addr {
    appliance::ADDRESS.parse().unwrap()
}

/// siteboot in full mode answering only its four hosts, from a 20-address pool.
fn siteboot(tag: &str) -> (Netns, Appliance) {
    let ns = appliance::lab_network(tag).unwrap();
    let mut config = appliance::lab_config("full");
    config["dhcp"]["known_hosts_only"] = json!(true);
    config["dhcp"]["subnets"][0]["pools"] = json!([format!("{POOL_FIRST}-{POOL_LAST}")]);
    config["hosts"] = json!(
        [ATTACKER_MAC, VICTIM_MAC, NEWCOMER_MAC, THIEF_MAC]
            .map(|mac| json!({ "mac": mac, "profile": appliance::LAB_PROFILE }))
    );
    let siteboot = Appliance::start(&ns, config).unwrap();
    (ns, siteboot)
}

/// Waits until siteboot has received one message counted in `series` (the forged one).
fn received(siteboot: &Appliance, series: &str) {
    siteboot_tests::wait::for_(series, LEASE_TIMEOUT, || {
        siteboot.metrics().ok().filter(|m| m.get(series) >= 1.0)
    })
    .unwrap();
}

/// A new client (udhcpc `-r`) asks for `address`; returns what it got.
fn ask_for(server: &Netns, mac: &str, address: Ipv4Addr) -> Ipv4Addr {
    let host = ClientHost::attach(server, appliance::BRIDGE, mac).unwrap();
    let mut client = Udhcpc::start(&host, &["-r", &address.to_string()]).unwrap();
    client.wait_bound(LEASE_TIMEOUT).unwrap().address.expect("lease without address")
}

/// On the code before the fix each DECLINE quarantined one more address (10 minutes), and
/// after 20 cycles no host of the site could get one.
#[test]
fn a_known_mac_cycling_request_and_decline_leaves_the_pool_to_others() {
    let (ns, siteboot) = siteboot("dhcpdecl");
    let attacker = ClientHost::attach(&ns, appliance::BRIDGE, ATTACKER_MAC).unwrap();
    let forger = ForgedDhcp::open(&attacker.ns, ClientHost::IFACE, server_address()).unwrap();
    let mut declined = 0;
    for _ in 0..30 {
        // No OFFER: the pool is empty (the old code), or a lost datagram; one more try.
        let Some(addr) = forger.lease(ATTACKER_MAC).unwrap() else { continue };
        forger.decline(ATTACKER_MAC, addr).unwrap();
        declined += 1;
    }
    assert!(declined > 0, "the attacker never got an address to decline");

    let host = ClientHost::attach(&ns, appliance::BRIDGE, NEWCOMER_MAC).unwrap();
    let mut newcomer = Udhcpc::start(&host, &[]).unwrap();
    let lease = newcomer.wait_bound(LEASE_TIMEOUT).expect("a host of the site got no address");
    let address = lease.address.expect("lease without address");
    assert!((POOL_FIRST..=POOL_LAST).contains(&address), "{address}");
    let ignored = siteboot.metrics().unwrap().get(DECLINES_IGNORED);
    assert_eq!(ignored, declined as f64, "each of the {declined} DECLINEs counted as ignored");
    assert_eq!(
        siteboot.log().matches("was not honoured").count(),
        1,
        "one log line per MAC per window:\n{}",
        siteboot.log()
    );
}

/// A RELEASE with the victim's `chaddr` and address, unicast from the thief's own address:
/// on the old code it ended the victim's lease, and the next client asking for the address
/// got it.
#[test]
fn a_forged_release_leaves_a_host_its_address() {
    let (ns, siteboot) = siteboot("dhcprel");
    let victim_host = ClientHost::attach(&ns, appliance::BRIDGE, VICTIM_MAC).unwrap();
    let mut victim = Udhcpc::start(&victim_host, &[]).unwrap();
    let address = victim.wait_bound(LEASE_TIMEOUT).unwrap().address.unwrap();

    // The thief is a host of the site with a lease of its own.
    let thief = ClientHost::attach(&ns, appliance::BRIDGE, THIEF_MAC).unwrap();
    let own = thief
        .ns
        .enter(|| {
            let dhcp = ThreadDhcp { iface: ClientHost::IFACE, mac: THIEF_MAC };
            dhcp.obtain(LEASE_TIMEOUT, || false)
        })
        .unwrap()
        .address
        .unwrap();
    assert_ne!(own, address);
    let forger = ForgedDhcp::open(&thief.ns, ClientHost::IFACE, server_address()).unwrap();
    forger.release(VICTIM_MAC, address).unwrap();
    received(&siteboot, RELEASES);

    assert_ne!(ask_for(&ns, NEWCOMER_MAC, address), address, "the victim's address was given away");
    let renewed = victim.renew(LEASE_TIMEOUT).unwrap();
    assert_eq!(renewed.address, Some(address), "{renewed:?}");
    assert_eq!(siteboot.metrics().unwrap().get(RELEASES_IGNORED), 1.0);
}

/// A DECLINE with the victim's `chaddr` and address (from 0.0.0.0, as every DECLINE): on the
/// old code the address was quarantined, the victim's renewal NAKed, and it had to move.
#[test]
fn a_forged_decline_leaves_a_host_its_address() {
    let (ns, siteboot) = siteboot("dhcpfdecl");
    let victim_host = ClientHost::attach(&ns, appliance::BRIDGE, VICTIM_MAC).unwrap();
    let mut victim = Udhcpc::start(&victim_host, &[]).unwrap();
    let address = victim.wait_bound(LEASE_TIMEOUT).unwrap().address.unwrap();

    let thief = ClientHost::attach(&ns, appliance::BRIDGE, THIEF_MAC).unwrap();
    let forger = ForgedDhcp::open(&thief.ns, ClientHost::IFACE, server_address()).unwrap();
    forger.decline(VICTIM_MAC, address).unwrap();
    received(&siteboot, DECLINES);

    let renewed = victim.renew(LEASE_TIMEOUT).unwrap();
    assert_eq!(renewed.address, Some(address), "the victim had to move: {renewed:?}");
    assert_ne!(ask_for(&ns, NEWCOMER_MAC, address), address, "the victim's address was given away");
    assert_eq!(siteboot.metrics().unwrap().get(DECLINES_IGNORED), 1.0);
}
