//! Failover of a site's DHCP between two replicas of the appliance on one segment, with the
//! real apiserver: the leader is killed (SIGKILL) under a steady stream of clients, then the
//! new leader is frozen (SIGSTOP) while the apiserver stays up and resumed, then the leader is
//! stopped (SIGTERM). Throughout, no address is given to two MACs (udhcpc's bindings, and
//! perfdhcp's own uniqueness check), every client that had a lease keeps it when it renews
//! with whichever replica leads, the frozen leader answers nothing once its term is over, and
//! SIGTERM hands the Lease over at once instead of leaving it to expire, and the replica that
//! lost its term while frozen and then leads again runs its reconcilers again. Every DHCPACK
//! either replica sends is captured on the wire and checked too. A client whose lease the
//! other replica granted is known by its address to the standby's boot plane, and to the new
//! leader's right after it takes over, before any DHCP reaches it: its boot script carries a
//! ramdisk token, which siteboot mints only for the address holding the MAC's lease.
//!
//! Failures panic while the processes are alive, so the appliances' logs get printed.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use siteboot_controller::crd::{Host, HostSpec, HostState, SITE_LABEL};
use siteboot_tests::appliance::{self, Appliance, mac_dashed};
use siteboot_tests::clients::{AckCapture, ClientHost, Udhcpc, perfdhcp};
use siteboot_tests::provider::{ProviderLab, SITE, SYSTEM_NS, host_name};
use siteboot_tests::{sim, wait};

const A: &str = "10.99.0.1";
const B: &str = "10.99.0.2";
const B_IDENTITY: &str = "replica-b";
const PERFDHCP: &str = "10.99.0.250";
/// The election's lease duration (controller::leader::Timing): a Lease left to expire is
/// taken over no sooner than this.
const LEASE_DURATION: Duration = Duration::from_secs(15);
const TAKEOVER: Duration = Duration::from_secs(60);
const BIND: Duration = Duration::from_secs(60);
/// How long a replica's boot plane may take to know a lease the other replica granted: a
/// standby reads the site's checkpoint every 5 s.
const KNOWN: Duration = Duration::from_secs(15);
/// The Host of the last client, which the test boots against each replica.
const LAST_CLIENT_HOST: &str = "client-8";

fn replica_config(cfg: &mut Value) {
    // The clients have no Host objects: answer every MAC.
    cfg["dhcp"]["known_hosts_only"] = json!(false);
    // perfdhcp sends as a relay from its own address.
    cfg["dhcp"]["trusted_relays"] = json!([PERFDHCP]);
}

/// Every (MAC, address) a client was bound to; panics if an address had two MACs.
#[derive(Default)]
struct Bindings(BTreeMap<Ipv4Addr, String>);

impl Bindings {
    fn record(&mut self, mac: &str, address: Ipv4Addr) {
        if let Some(other) = self.0.insert(address, mac.to_owned()) {
            assert_eq!(other, mac, "{address} was given to two MACs");
        }
    }

    fn record_all(&mut self, mac: &str, client: &Udhcpc) {
        for lease in client.events() {
            if let ("bound" | "renew", Some(address)) = (lease.event.as_str(), lease.address) {
                self.record(mac, address);
            }
        }
    }
}

async fn holder(lab: &ProviderLab) -> Option<String> {
    let leases = Api::<Lease>::namespaced(lab.env.client(), SYSTEM_NS);
    let lease = leases.get_opt(&format!("siteboot-{SITE}")).await.ok()??;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

/// Waits until the Lease is held by someone `is_wanted` accepts; returns the holder.
async fn wait_holder(lab: &ProviderLab, what: &str, is_wanted: impl Fn(&str) -> bool) -> String {
    match wait::for_async(what, TAKEOVER, || async { holder(lab).await.filter(|h| is_wanted(h)) })
        .await
    {
        Ok(holder) => holder,
        Err(e) => panic!("{e}; the Lease is held by {:?}", holder(lab).await),
    }
}

/// No address was ACKed to two MACs by either replica (no lease in this test is released or
/// expires, so an address never moves).
fn assert_acks_unique(captures: &[&AckCapture]) {
    let mut owners: BTreeMap<Ipv4Addr, String> = BTreeMap::new();
    for (mac, address) in captures.iter().flat_map(|c| c.acks()) {
        if let Some(other) = owners.insert(address, mac.clone()) {
            assert_eq!(other, mac, "{address} was ACKed to two MACs");
        }
    }
    assert!(!owners.is_empty(), "no DHCPACK was captured");
}

fn dhcp_replies_sent(siteboot: &Appliance) -> f64 {
    let metrics = siteboot.metrics().unwrap();
    metrics
        .0
        .iter()
        .filter(|(series, _)| {
            series.starts_with("siteboot_dhcp_messages_total") && series.contains("\"sent\"")
        })
        .map(|(_, v)| v)
        .sum()
}

/// Whether `server` knows `host` by its address: the boot script it serves the host's MAC (a
/// Host in Inspecting) carries a ramdisk token, which siteboot mints only for a request from
/// the address that holds the MAC's lease. Asked until it does, for at most [`KNOWN`].
fn knows_by_address(host: &ClientHost, server: &str) -> bool {
    let url =
        format!("http://{server}:{}/boot/{}.ipxe", appliance::HTTP_PORT, mac_dashed(&host.mac));
    let known = wait::for_(&format!("{server} to know {} by its address", host.mac), KNOWN, || {
        let (status, script) = sim::http_get(&host.ns, &url).ok()?;
        (status == 200 && script.contains("siteboot.token=")).then_some(())
    });
    known.is_ok()
}

fn renew_same(client: &mut Udhcpc, mac: &str, had: Ipv4Addr, bindings: &mut Bindings) -> Ipv4Addr {
    let lease = client.renew(BIND).unwrap();
    bindings.record_all(mac, client);
    assert_eq!(lease.address, Some(had), "{mac} lost its address on renewal: {lease:?}");
    lease.server.expect("the renewing server")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dhcp_fails_over_between_replicas_without_giving_an_address_twice() {
    let lab = ProviderLab::start(0, replica_config).await.unwrap();
    let first = wait_holder(&lab, "the first appliance to lead", |_| true).await;
    assert_ne!(first, B_IDENTITY);
    let b = lab.replica(B, B_IDENTITY, replica_config).unwrap();
    // A's replies leave by the lab bridge, B's by its own eth0.
    let acks_a = AckCapture::start(&lab.lab, appliance::BRIDGE).unwrap();
    let acks_b = AckCapture::start(&b.ns, "eth0").unwrap();

    let hosts: Vec<ClientHost> = (1..=8)
        .map(|n| {
            ClientHost::attach(&lab.lab, appliance::BRIDGE, &format!("52:54:00:00:0f:{n:02x}"))
        })
        .collect::<anyhow::Result<_>>()
        .unwrap();
    // The last client is a machine of the site being inspected: its boot script carries a token
    // when the replica knows it by its address.
    let mut host = Host::new(LAST_CLIENT_HOST, HostSpec::new(hosts[7].mac.clone()));
    host.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
    lab.hosts().create(&PostParams::default(), &host).await.unwrap();
    let mut bindings = Bindings::default();
    let mut clients: Vec<Udhcpc> = Vec::new();
    let mut addresses: Vec<Ipv4Addr> = Vec::new();
    let bind = |host: &ClientHost, clients: &mut Vec<Udhcpc>, bindings: &mut Bindings| {
        let mut client = Udhcpc::start(host, &[]).unwrap();
        let lease = client.wait_bound(BIND).unwrap();
        bindings.record_all(&host.mac, &client);
        clients.push(client);
        (lease.address.unwrap(), lease.server.unwrap())
    };

    // 1. A leads and binds four clients.
    for host in &hosts[..4] {
        let (address, server) = bind(host, &mut clients, &mut bindings);
        assert_eq!(server.to_string(), A);
        addresses.push(address);
    }

    // 2. SIGKILL A under a steady stream of clients (perfdhcp: 5 exchanges/s, 20 MACs).
    let perf_host = ClientHost::attach(&lab.lab, appliance::BRIDGE, "52:54:00:00:0f:f0").unwrap();
    let perf =
        std::thread::spawn(move || perfdhcp(&perf_host, &format!("{PERFDHCP}/24"), 5, 20, 35));
    tokio::time::sleep(Duration::from_secs(5)).await;
    lab.siteboot.kill9();
    wait_holder(&lab, "B to take over from the killed leader", |h| h == B_IDENTITY).await;
    // New clients first: B must not hand them what A's clients hold.
    for host in &hosts[4..6] {
        let (address, server) = bind(host, &mut clients, &mut bindings);
        assert_eq!(server.to_string(), B);
        addresses.push(address);
    }
    for (i, client) in clients.iter_mut().enumerate().take(4) {
        // The renewal goes to A, which is gone; the rebinding broadcast reaches B.
        let server = renew_same(client, &hosts[i].mac, addresses[i], &mut bindings);
        assert_eq!(server.to_string(), B, "{} renewed with {server}", hosts[i].mac);
    }
    let report = perf.join().unwrap().unwrap();
    for exchange in &report.exchanges {
        assert_eq!(exchange.rejected_leases, 0, "{}", report.output);
    }
    assert!(
        report.exchange("REQUEST-ACK").is_some_and(|e| e.received > 0),
        "perfdhcp got no lease at all:\n{}",
        report.output
    );

    // 3. A comes back as a standby; B, the leader, is frozen while the apiserver stays up.
    lab.siteboot.restart().unwrap();
    let sent_before = dhcp_replies_sent(&b.siteboot);
    b.siteboot.signal(libc::SIGSTOP);
    let frozen_at = Instant::now();
    let a_identity =
        wait_holder(&lab, "A to take over from the frozen leader", |h| h != B_IDENTITY).await;
    eprintln!("takeover from the frozen leader after {:?}", frozen_at.elapsed());
    let (address, server) = bind(&hosts[6], &mut clients, &mut bindings);
    assert_eq!(server.to_string(), A);
    addresses.push(address);
    // B wakes up with client 7's requests queued and client 8 asking: it must answer nothing.
    b.siteboot.signal(libc::SIGCONT);
    let (address, server) = bind(&hosts[7], &mut clients, &mut bindings);
    assert_eq!(server.to_string(), A);
    addresses.push(address);
    let inspecting = wait::for_async("client 8's Host to be Inspecting", TAKEOVER, || async {
        let states = lab.host_states().await.ok()?;
        (states.get(LAST_CLIENT_HOST) == Some(&HostState::Inspecting)).then_some(())
    });
    inspecting.await.unwrap();
    // B, a standby, learns client 8's lease (A's) from the site's checkpoint.
    let standby_knew = knows_by_address(&hosts[7], B);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        dhcp_replies_sent(&b.siteboot),
        sent_before,
        "the frozen leader answered DHCP after its term ended"
    );
    assert_eq!(holder(&lab).await.as_deref(), Some(a_identity.as_str()));

    // 4. SIGTERM A: it gives the Lease back, B takes it at once, and every lease is kept.
    let stopping = Instant::now();
    lab.siteboot.signal(libc::SIGTERM);
    wait_holder(&lab, "B to take over from the stopped leader", |h| h == B_IDENTITY).await;
    let handover = stopping.elapsed();
    eprintln!("SIGTERM handover took {handover:?}");
    assert!(
        handover < LEASE_DURATION,
        "the Lease was left to expire ({handover:?}) instead of being given back"
    );
    // Right after the takeover, before any DHCP reaches B: client 8 boots against the new
    // leader, which knows it by the address A leased it.
    let leader_knew = knows_by_address(&hosts[7], B);
    assert!(
        standby_knew && leader_knew,
        "B did not know client 8 ({}) by its address {}: as a standby: {standby_knew}, right \
         after taking over: {leader_knew}",
        hosts[7].mac,
        addresses[7]
    );
    let exited =
        wait::until("A to exit", Duration::from_secs(30), Duration::from_millis(100), || {
            lab.siteboot.exited()
        })
        .unwrap();
    assert!(exited.success(), "A exited with {exited}:\n{}", lab.siteboot.log());
    for (i, client) in clients.iter_mut().enumerate() {
        let server = renew_same(client, &hosts[i].mac, addresses[i], &mut bindings);
        assert_eq!(server.to_string(), B, "{} renewed with {server}", hosts[i].mac);
    }
    assert!(b.siteboot.exited().is_none(), "B is still serving");
    assert_acks_unique(&[&acks_a, &acks_b]);

    // 5. B lost its term while frozen and leads again: its reconcilers started again too. With
    // A gone, only B can take up a new Host.
    assert!(
        b.siteboot.log().contains("no longer leading: reconcilers stopped"),
        "B's term did not end while it was frozen:\n{}",
        b.siteboot.log()
    );
    lab.create_host(0).await.unwrap();
    let taken_up = wait::for_async("B to reconcile a new Host", TAKEOVER, || async {
        lab.host_states().await.ok()?.remove(&host_name(0))
    })
    .await;
    if let Err(e) = taken_up {
        panic!(
            "{e}; B regained the Lease but did not restart its reconcilers:\n{}",
            b.siteboot.log()
        );
    }
}
