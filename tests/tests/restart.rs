//! Leases survive a crash: clients get leases, siteboot is killed with SIGKILL (once while a
//! burst of clients is in flight) and started again; every MAC gets its address back and no
//! address is ever given to two MACs.
//!
//! Failures panic (`unwrap`) while the processes are alive, so their logs get printed.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::clients::{ClientHost, Udhcpc};
use siteboot_tests::netns::Netns;

const LEASE_TIMEOUT: Duration = Duration::from_secs(60);

fn siteboot(tag: &str) -> (Netns, Appliance) {
    let ns = appliance::lab_network(tag).unwrap();
    let siteboot = Appliance::start(&ns, appliance::lab_config("full")).unwrap();
    (ns, siteboot)
}

fn attach_hosts(ns: &Netns, first: u8, count: u8) -> Vec<ClientHost> {
    (first..first + count)
        .map(|n| ClientHost::attach(ns, appliance::BRIDGE, &format!("52:54:00:00:03:{n:02x}")))
        .collect::<anyhow::Result<_>>()
        .unwrap()
}

fn start_clients(hosts: &[ClientHost]) -> Vec<Udhcpc> {
    hosts.iter().map(|host| Udhcpc::start(host, &[])).collect::<anyhow::Result<_>>().unwrap()
}

/// Every (MAC, address) a client was ever bound to, across all runs.
#[derive(Default)]
struct Bindings(Vec<(String, Ipv4Addr)>);

impl Bindings {
    fn record(&mut self, mac: &str, client: &Udhcpc) {
        for lease in client.events() {
            if let ("bound" | "renew", Some(address)) = (lease.event.as_str(), lease.address) {
                self.0.push((mac.to_owned(), address));
            }
        }
    }

    fn assert_unique(&self) {
        let mut owners: BTreeMap<Ipv4Addr, &str> = BTreeMap::new();
        for (mac, address) in &self.0 {
            if let Some(other) = owners.insert(*address, mac) {
                assert_eq!(other, mac, "{address} was given to two MACs");
            }
        }
    }
}

/// Waits until every client is bound, records the bindings, then kills the clients without a
/// release (like machines losing power). Returns MAC -> address.
fn collect(
    hosts: &[ClientHost],
    clients: &mut [Udhcpc],
    bindings: &mut Bindings,
) -> BTreeMap<String, Ipv4Addr> {
    let mut leased = BTreeMap::new();
    for (host, client) in hosts.iter().zip(clients) {
        let lease = client.wait_bound(LEASE_TIMEOUT).unwrap();
        leased.insert(host.mac.clone(), lease.address.expect("lease without address"));
        bindings.record(&host.mac, client);
        client.kill();
    }
    leased
}

/// One fresh udhcpc per host, with no requested address: siteboot must know the MAC.
fn lease_all(hosts: &[ClientHost], bindings: &mut Bindings) -> BTreeMap<String, Ipv4Addr> {
    let mut clients = start_clients(hosts);
    collect(hosts, &mut clients, bindings)
}

#[test]
fn leases_survive_kill9_and_restart() {
    let (ns, siteboot) = siteboot("restart");
    let hosts = attach_hosts(&ns, 0x10, 6);
    let newcomers = attach_hosts(&ns, 0x30, 3);
    let mut bindings = Bindings::default();

    let before = lease_all(&hosts, &mut bindings);
    siteboot.kill9();
    siteboot.restart().unwrap();
    // New MACs ask first: had siteboot forgotten the leases, they would get the old addresses
    // (allocation order is otherwise the same) and the check below would catch it.
    lease_all(&newcomers, &mut bindings);
    let after = lease_all(&hosts, &mut bindings);

    assert_eq!(before, after, "addresses changed across kill -9 and restart");
    bindings.assert_unique();
}

#[test]
fn kill9_during_a_burst_loses_no_lease() {
    let (ns, siteboot) = siteboot("burst");
    let hosts = attach_hosts(&ns, 0x20, 10);
    let newcomers = attach_hosts(&ns, 0x40, 3);
    let mut bindings = Bindings::default();

    // Start every client at once and kill siteboot as soon as the first is bound: the others
    // are somewhere between DISCOVER and ACK. udhcpc keeps retrying until siteboot is back.
    let mut clients = start_clients(&hosts);
    siteboot_tests::wait::until(
        "a first client to be bound",
        LEASE_TIMEOUT,
        Duration::from_millis(10),
        || clients.iter().any(|c| c.events().iter().any(|l| l.event == "bound")).then_some(()),
    )
    .unwrap();
    siteboot.kill9();
    siteboot.restart().unwrap();
    let first = collect(&hosts, &mut clients, &mut bindings);
    bindings.assert_unique();

    // A second crash, then every MAC asks again and must get what it had.
    siteboot.kill9();
    siteboot.restart().unwrap();
    lease_all(&newcomers, &mut bindings);
    let again = lease_all(&hosts, &mut bindings);
    assert_eq!(first, again, "addresses changed across kill -9 and restart");
    bindings.assert_unique();
}
