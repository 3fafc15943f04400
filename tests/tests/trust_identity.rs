//! Which MAC is behind a client address comes only from what siteboot can stand behind
//! (docs: design.md, "Bootstrap data and trust"): the lease it ACKed, checked against the ARP
//! table, never a packet's `chaddr`. Here another machine of the site forges the MAC of a host
//! being provisioned in one DHCP packet, then asks for that host's boot script and bootstrap
//! data from its own address: it must get neither a token nor the data.
//!
//! Failures panic (`unwrap`) while everything is alive, so the logs get printed.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, PostParams};
use siteboot_boot::neighbors::{ArpTable, KernelArp};
use siteboot_controller::crd::{Host, HostSpec, HostState, SITE_LABEL};
use siteboot_tests::appliance::{self, mac_dashed};
use siteboot_tests::clients::{ClientHost, Udhcpc};
use siteboot_tests::netns::Netns;
use siteboot_tests::provider::{NS, ProviderLab, SITE, Sims};
use siteboot_tests::sim::{self, SimHost};

const ROLLOUT: Duration = Duration::from_secs(300);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const INTRUDER_MAC: &str = "52:54:00:00:0d:02";
const SECRET: &str = "#cloud-config\nkubeadm-join-token: abcdef.0123456789abcdef\n";

const DHCP_REQUEST: u8 = 3;
const DHCP_ACK: u8 = 5;
const DHCP_RELEASE: u8 = 7;

/// Port 4011 (proxyDHCP boot server): a REQUEST with the victim's MAC and iPXE's user class,
/// sent from the intruder's own leased address.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forged_chaddr_on_port_4011_gives_no_identity() {
    let lab = provisioning_lab().await;
    let (victim, victim_token) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;

    let request = bootp(
        victim.mac(),
        Ipv4Addr::UNSPECIFIED,
        &[&[53, 1, DHCP_REQUEST], &[77, 4, b'i', b'P', b'X', b'E'], &[93, 2, 0, 0]],
    );
    let reply = intruder.send(0, SocketAddrV4::new(SERVER, 4011), request, true);
    assert_eq!(message_type(&reply.expect("an answer from port 4011")), Some(DHCP_ACK));

    intruder.assert_gets_nothing(&victim, &victim_token);
}

/// The ARP evidence above comes from the kernel's entry for one address on the interface
/// siteboot serves: a complete entry names its MAC (whatever its state); an incomplete entry, an
/// entry on another interface, or none name nothing.
#[test]
fn the_arp_lookup_reads_the_served_interface_s_entries_only() {
    let ns = Netns::new("arp").unwrap();
    for (link, cidr) in [("served", "10.77.0.1/24"), ("other", "10.78.0.1/24")] {
        ns.ip(&["link", "add", link, "type", "veth", "peer", "name", &format!("{link}-p")])
            .unwrap();
        ns.ip(&["link", "set", link, "up"]).unwrap();
        ns.ip(&["link", "set", &format!("{link}-p"), "up"]).unwrap();
        ns.ip(&["addr", "add", cidr, "dev", link]).unwrap();
    }
    for entry in [
        "10.77.0.10 lladdr 52:54:00:00:77:10 dev served nud reachable",
        "10.77.0.11 lladdr 52:54:00:00:77:11 dev served nud stale",
        "10.77.0.12 lladdr 52:54:00:00:77:12 dev served nud permanent",
        "10.77.0.13 dev served nud incomplete",
        "10.78.0.10 lladdr 52:54:00:00:78:10 dev other nud permanent",
    ] {
        let mut args = vec!["neigh", "add"];
        args.extend(entry.split(' '));
        ns.ip(&args).unwrap();
    }
    let found = ns
        .enter(|| {
            let arp = KernelArp::new("served")?;
            Ok(["10.77.0.10", "10.77.0.11", "10.77.0.12", "10.77.0.13", "10.77.0.14", "10.78.0.10"]
                .map(|a| arp.lookup(a.parse().unwrap()).map(|mac| mac.to_string())))
        })
        .unwrap();
    let mac = |s: &str| Some(s.to_owned());
    assert_eq!(
        found,
        [
            mac("52:54:00:00:77:10"),
            mac("52:54:00:00:77:11"),
            mac("52:54:00:00:77:12"),
            None, // incomplete
            None, // no entry
            None, // another interface's
        ]
    );
}

/// Port 67, full mode: the intruder gives its lease back and asks for the same address as the
/// victim. siteboot cannot tell this from the victim moving, so it ACKs; but the ARP table says
/// the address is the intruder's, and that must win over the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_taken_with_a_forged_chaddr_gives_no_identity() {
    let lab = provisioning_lab().await;
    let (victim, victim_token) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;

    // Without the release, the address is the intruder's lease and the REQUEST is NAKed.
    let mut release = vec![53, 1, DHCP_RELEASE, 54, 4];
    release.extend_from_slice(&SERVER.octets());
    let release = bootp(INTRUDER_MAC, intruder.address, &[&release]);
    intruder.send(0, SocketAddrV4::new(SERVER, 67), release, false);
    // RENEWING: ciaddr set, so the ACK comes back unicast to the intruder's port 68.
    let request = bootp(victim.mac(), intruder.address, &[&[53, 1, DHCP_REQUEST]]);
    let reply = intruder.send(68, SocketAddrV4::new(SERVER, 67), request, true);
    assert_eq!(
        message_type(&reply.expect("an answer to the forged REQUEST")),
        Some(DHCP_ACK),
        "the forged REQUEST was not ACKed: the test did not make the attack it means to"
    );

    intruder.assert_gets_nothing(&victim, &victim_token);
}

/// Any machine on the segment can ask for a host's boot script. Each ask from an address that
/// does not hold the MAC is worth a Warning Event, but 200 of them must not become 200 writes
/// to the API server (nor 200 log lines): at most one Event per Host and reason a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_boot_script_requests_writes_one_event() {
    let lab = provisioning_lab().await;
    let (victim, _) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;
    let host = host_of(&lab, &victim).await;

    let url = format!("{}/boot/{}.ipxe", intruder.base_url, mac_dashed(victim.mac()));
    let mut curl = intruder.host.ns.command("curl");
    curl.args(["-sS", "-w", "%{http_code}\n"]);
    for _ in 0..200 {
        curl.args(["-o", "/dev/null", &url]);
    }
    let codes = siteboot_tests::netns::output(&mut curl).unwrap();
    assert_eq!(codes.lines().filter(|c| *c == "200").count(), 200, "{codes}");

    // Each script is answered after its Event was written, so all of them are in by now.
    let events: Api<Event> = Api::namespaced(lab.env.client(), NS);
    let refused: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some("TokenRefused")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(host.as_str())
        })
        .collect();
    // A repeated Event is one object whose series counts the writes.
    let writes: i32 = refused.iter().map(|e| e.series.as_ref().map_or(1, |s| s.count)).sum();
    let notes: Vec<_> = refused.iter().map(|e| e.note.clone().unwrap_or_default()).collect();
    assert!((1..=2).contains(&writes), "{writes} TokenRefused writes for {host}: {notes:?}");
    let logged = lab.siteboot.log().matches("does not hold its MAC").count();
    assert!(logged <= 2, "{logged} log lines for the refused scripts");
}

/// What every machine on the segment reads of a claimed host that is being provisioned (the
/// status page's stream, `/timeline`, `/metrics`): its name, state and steps, but not its
/// tenant (the SitebootMachine's name; the lab's tenant shares the Hosts' namespace) nor its
/// operation's id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_segment_reads_no_tenant_or_operation_of_a_claimed_host() {
    let lab = provisioning_lab().await;
    let (victim, _) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;
    let host = lab.hosts().get(&host_of(&lab, &victim).await).await.unwrap();
    let consumer = host.spec.consumer_ref.clone().expect("the victim is claimed");
    let operation = host.status.and_then(|s| s.operation).expect("an operation").id;

    let mac = victim.mac().to_owned();
    let mut stream = intruder.host.ns.command("curl");
    stream.args(["-sS", "-m", "3", &format!("{}/status/events", intruder.base_url)]);
    // Ended by `-m`: the stream never ends by itself.
    let stream = String::from_utf8_lossy(&stream.output().unwrap().stdout).into_owned();
    assert!(stream.contains(&mac) && stream.contains("Provisioning"), "{stream}");
    let timeline = intruder.get(&format!("/timeline/{mac}")).1;
    assert!(timeline.contains("ipxe-script"), "{timeline}");
    let published = [stream, timeline, intruder.get("/timeline").1, intruder.get("/metrics").1];
    for text in published {
        for secret in [&consumer.name, &consumer.uid, &operation] {
            assert!(!text.contains(secret.as_str()), "{secret} is published: {text}");
        }
    }
}

/// The name of the Host whose boot MAC is `sim`'s.
async fn host_of(lab: &ProviderLab, sim: &SimHost) -> String {
    let hosts = lab.hosts().list(&ListParams::default()).await.unwrap();
    hosts
        .items
        .into_iter()
        .find(|h| h.spec.boot_mac_address == sim.mac())
        .and_then(|h| h.metadata.name)
        .unwrap()
}

/// A Kubernetes-mode lab with one manual simulated host and a Cluster whose bootstrap data is
/// [`SECRET`].
async fn provisioning_lab() -> ProviderLab {
    ProviderLab::start_with(Sims { count: 1, manual: 1 }, |_| {}).await.unwrap()
}

/// Inspects the lab's host by hand, claims it with a MachineDeployment of 1 and waits until it
/// is provisioning with a fresh token on its ramdisk command line.
async fn provisioning_victim(lab: &ProviderLab) -> (Arc<SimHost>, String) {
    let sim = lab.sims().remove(0);
    let inspection = wait_token(&sim, None).await;
    let (status, body) = sim
        .http(
            "POST",
            "/agent/v1/inspection",
            Some(&inspection),
            Some(&siteboot_tests::sim::hardware()),
        )
        .unwrap();
    assert_eq!(status, 200, "{body}");
    lab.wait_hosts(HostState::Available, 1, Duration::from_secs(60)).await.unwrap();
    lab.create_cluster("c", SECRET).await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c", "t", 1).await.unwrap();
    lab.wait_hosts(HostState::Provisioning, 1, ROLLOUT).await.unwrap();
    sim.reboot();
    let token = wait_token(&sim, Some(&inspection)).await;
    (sim, token)
}

/// The token on the host's ramdisk command line (other than `not`).
async fn wait_token(sim: &SimHost, not: Option<&str>) -> String {
    siteboot_tests::wait::for_async("a ramdisk token", Duration::from_secs(60), || async {
        sim.token().filter(|t| Some(t.as_str()) != not)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}:\n{}", sim.log()))
}

/// Another machine of the site: a Host object exists for it (so it gets a lease whatever the
/// DHCP admission rules), and it holds a lease on the lab bridge.
struct Intruder {
    host: ClientHost,
    address: Ipv4Addr,
    base_url: String,
}

impl Intruder {
    async fn join(lab: &ProviderLab) -> Self {
        let mut object = Host::new("intruder", HostSpec::new(INTRUDER_MAC));
        object.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
        lab.hosts().create(&PostParams::default(), &object).await.unwrap();
        let host = ClientHost::attach(&lab.lab, appliance::BRIDGE, INTRUDER_MAC).unwrap();
        let mut dhcp = Udhcpc::start(&host, &[]).unwrap();
        let lease = dhcp.wait_bound(Duration::from_secs(60)).unwrap();
        // The address stays on the interface; port 68 is free for the forged exchanges.
        dhcp.kill();
        Self { host, address: lease.address.unwrap(), base_url: lab.siteboot.base_url().to_owned() }
    }

    /// Sends `packet` from the intruder's address and `port` (0: any) to `to`; with `answer`,
    /// waits up to 5 s for the reply.
    fn send(&self, port: u16, to: SocketAddrV4, packet: Vec<u8>, answer: bool) -> Option<Vec<u8>> {
        let from = SocketAddrV4::new(self.address, port);
        self.host
            .ns
            .enter(move || {
                let socket = UdpSocket::bind(from)?;
                socket.set_read_timeout(Some(Duration::from_secs(5)))?;
                socket.send_to(&packet, to)?;
                if !answer {
                    return Ok(None);
                }
                let mut buf = vec![0u8; 1500];
                let n = socket.recv(&mut buf)?;
                buf.truncate(n);
                Ok(Some(buf))
            })
            .unwrap()
    }

    /// `curl` from the intruder's address: (status, body).
    fn get(&self, path: &str) -> (u16, String) {
        let mut command = self.host.ns.command("curl");
        command.args(["-sS", "-o", "-", "-w", "\n%{http_code}"]);
        let out =
            siteboot_tests::netns::output(command.arg(format!("{}{path}", self.base_url))).unwrap();
        let (body, status) = out.rsplit_once('\n').unwrap();
        (status.trim().parse().unwrap(), body.to_owned())
    }

    /// The victim's boot script carries no token for the intruder, and the bootstrap data is
    /// refused even with the best token it can have: one from that script, or the victim's own.
    fn assert_gets_nothing(&self, victim: &SimHost, victim_token: &str) {
        let (status, script) = self.get(&format!("/boot/{}.ipxe", mac_dashed(victim.mac())));
        assert_eq!(status, 200, "{script}");
        let stolen = script
            .split_whitespace()
            .find_map(|w| w.strip_prefix("siteboot.token="))
            .map(str::to_owned);
        let token = stolen.as_deref().unwrap_or(victim_token);
        // Over HTTPS, as the ramdisk does, with the URL and pin from the victim's script.
        let agent = sim::agent_client(&sim::ramdisk_cmdline(&script).unwrap());
        let (status, data) =
            sim::agent_http(&self.host.ns, &agent, "GET", "/agent/v1/bootstrap", Some(token), None)
                .unwrap();
        assert!(
            stolen.is_none() && status == 403,
            "the intruder at {} got a token: {stolen:?}; bootstrap answered {status}: {data:?}",
            self.address
        );
        assert!(!data.contains("abcdef.0123456789abcdef"), "the join secret leaked");
    }
}

/// A BOOTREQUEST from `mac` with `ciaddr` and the given options (each `[code, len, value..]`).
fn bootp(mac: &str, ciaddr: Ipv4Addr, options: &[&[u8]]) -> Vec<u8> {
    let mut p = vec![0u8; 236];
    p[0] = 1; // BOOTREQUEST
    p[1] = 1; // Ethernet
    p[2] = 6;
    p[4..8].copy_from_slice(&0x5eed_0001u32.to_be_bytes());
    p[12..16].copy_from_slice(&ciaddr.octets());
    for (i, byte) in mac.split(':').enumerate() {
        p[28 + i] = u8::from_str_radix(byte, 16).unwrap();
    }
    p.extend_from_slice(&[99, 130, 83, 99]);
    for option in options {
        p.extend_from_slice(option);
    }
    p.push(255);
    p
}

/// Option 53 of a reply.
fn message_type(reply: &[u8]) -> Option<u8> {
    let mut rest = reply.get(240..)?;
    while let [code, tail @ ..] = rest {
        match code {
            0 => rest = tail,
            255 => return None,
            _ => {
                let (&len, tail) = tail.split_first()?;
                let value = tail.get(..len as usize)?;
                if *code == 53 {
                    return value.first().copied();
                }
                rest = &tail[len as usize..];
            }
        }
    }
    None
}
