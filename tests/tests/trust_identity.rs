//! Which MAC is behind a client address comes only from what siteboot can stand behind
//! (docs: design.md, "Bootstrap data and trust"): the lease it ACKed, checked against the ARP
//! table, never a packet's `chaddr`. Here another machine of the site forges the MAC of a host
//! being provisioned in one DHCP packet, then asks for that host's boot script and bootstrap
//! data from its own address: it must get neither a token nor the data, also when it leaves the
//! appliance's ARP entry for its address naming no one (zeroed, or never answered) or plants one
//! naming the victim (then only the appliance's own ARP probe tells it from the victim).
//!
//! Failures panic (`unwrap`) while everything is alive, so the logs get printed.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, PostParams};
use siteboot_boot::MacAddr;
use siteboot_boot::arp_probe::{ArpClaim, ArpProbe, PacketProbe, Unconfirmed, judge};
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

/// The appliance's own ARP probe on a real interface: a broadcast who-has from the served
/// bridge, and every claim to the address seen in time. The neighbour's kernel answers from its
/// own MAC (confirmed); an address no one has gets no answer; and a second machine announcing
/// the neighbour's MAC from its own Ethernet address while the probe listens is a conflict.
#[test]
fn the_arp_probe_confirms_only_the_machine_that_answers_as_itself() {
    let served = Netns::new("probe").unwrap();
    served.add_bridge("br-probe", "10.79.0.1/24").unwrap();
    // Made before the ports join: the bridge's MAC changes as they do.
    let appliance = Ipv4Addr::new(10, 79, 0, 1);
    let made = served.enter(move || Ok(PacketProbe::new("br-probe", appliance)?)).unwrap();
    let made = Arc::new(made);
    let neighbour = ClientHost::attach(&served, "br-probe", "52:54:00:00:79:10").unwrap();
    neighbour.ns.ip(&["addr", "add", "10.79.0.10/24", "dev", ClientHost::IFACE]).unwrap();
    let planter = ClientHost::attach(&served, "br-probe", INTRUDER_MAC).unwrap();
    let (address, absent) = (Ipv4Addr::new(10, 79, 0, 10), Ipv4Addr::new(10, 79, 0, 11));
    let lessee: MacAddr = neighbour.mac.parse().unwrap();
    // Probes run on a thread in the served namespace, as siteboot runs there.
    let probe = |target: Ipv4Addr| {
        let probe = made.clone();
        served
            .enter(move || {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                Ok(runtime.block_on(probe.probe(target))?)
            })
            .unwrap()
    };

    let answered = probe(address);
    assert!(
        answered.contains(&ArpClaim { ethernet_source: lessee, sender: lessee, is_reply: true }),
        "{answered:?}"
    );
    assert_eq!(judge(lessee, &answered), Ok(()));
    assert_eq!(judge(lessee, &probe(absent)), Err(Unconfirmed::NoAnswer));

    let socket = planter.ns.enter(|| packet_socket(libc::ETH_P_ARP, false)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let planting = std::thread::spawn(move || {
        while !flag.load(Ordering::Acquire) {
            send_gratuitous_arp(&socket, address, lessee.octets()).unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let planted = probe(address);
    stop.store(true, Ordering::Release);
    planting.join().unwrap();
    let intruder: MacAddr = INTRUDER_MAC.parse().unwrap();
    assert!(
        planted.contains(&ArpClaim { ethernet_source: intruder, sender: lessee, is_reply: false }),
        "{planted:?}"
    );
    assert_eq!(judge(lessee, &planted), Err(Unconfirmed::Conflict { other: intruder }));
}

/// Port 67, full mode: the intruder gives its lease back and asks for the same address as the
/// victim. siteboot cannot tell this from the victim moving, so it ACKs; but the ARP table says
/// the address is the intruder's, and that must win over the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_taken_with_a_forged_chaddr_gives_no_identity() {
    let lab = provisioning_lab().await;
    let (victim, victim_token) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;
    intruder.take_lease_of(&victim);
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

/// The same forged lease, and then no ARP entry contradicts it: the intruder poisons the
/// appliance's entry for its address with an all-zero MAC (a gratuitous ARP from its own
/// namespace) while it asks, and restores its own MAC to read the answer. The victim's MAC never
/// appears on the wire: only a complete entry naming it could give the address its identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forged_lease_with_a_zeroed_arp_entry_gives_no_identity() {
    let lab = provisioning_lab().await;
    let (victim, victim_token) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;
    intruder.take_lease_of(&victim);
    intruder.assert_gets_nothing_without_arp(&lab, Spoil::ZeroMac, &victim, &victim_token);
}

/// The same forged lease, and the intruder answers no ARP while it asks, so the appliance's
/// entry for its address is incomplete, then failed; it answers again to read the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forged_lease_with_arp_unanswered_gives_no_identity() {
    let lab = provisioning_lab().await;
    let (victim, victim_token) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;
    intruder.take_lease_of(&victim);
    intruder.assert_gets_nothing_without_arp(&lab, Spoil::Unanswered, &victim, &victim_token);
}

/// The same forged lease, and an entry that does name the victim: the intruder plants "its
/// address is-at the victim's MAC" with gratuitous ARPs from its own Ethernet address (and keeps
/// sending them, answering no ARP itself), on a bridge that floods every frame (`ageing_time
/// 0`: a hub, or any switch that has not learnt the victim's MAC, say while it is off), so the
/// answers sent to the victim's MAC reach the intruder. Only the appliance's own ARP probe,
/// whose answer must come from the lessee's MAC as both Ethernet and ARP sender, tells this
/// from the victim. The control: the victim itself, answering for its own address, still gets
/// a token and its bootstrap data.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forged_lease_with_an_arp_entry_planted_for_the_victim_gives_no_identity() {
    let lab = provisioning_lab().await;
    let (victim, victim_token) = provisioning_victim(&lab).await;
    let intruder = Intruder::join(&lab).await;
    intruder.take_lease_of(&victim);
    lab.lab.ip(&["link", "set", appliance::BRIDGE, "type", "bridge", "ageing_time", "0"]).unwrap();
    let sniffer = Sniffer::start(&intruder.host, mac_bytes(victim.mac()));
    let planted = Spoil::NamingTheVictim(mac_bytes(victim.mac()));
    intruder.assert_gets_nothing_without_arp(&lab, planted, &victim, &victim_token);
    let flooded = sniffer.stop();
    assert!(
        flooded.iter().any(|frame| contains(frame, b"#!ipxe")),
        "no boot script sent to the victim's MAC reached the intruder: the test did not make the attack it means to"
    );
    assert!(
        !flooded.iter().any(|frame| contains(frame, b"siteboot.token=")),
        "a token left to the segment"
    );

    // The victim boots again once the intruder has let the address go.
    intruder.release_lease_of(&victim);
    victim.reboot();
    let token = wait_token(&victim, Some(&victim_token)).await;
    let (status, data) = victim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, data.as_str()), (200, SECRET));
}

/// The moment secrets leave (item 1, at release): the victim's token was minted genuinely, to
/// the victim's address, and read off a segment that floods (`ageing_time 0`). While the victim
/// is away (between its script and its first agent call, say), the intruder takes the victim's
/// address, answers no ARP, keeps the appliance's ARP entry naming the victim (gratuitous ARPs
/// from its own Ethernet address) while it asks, and names itself again to read the answer.
/// The lease and the entry both name the victim; only the appliance's ARP probe as the data
/// leaves, which nobody answers as the victim, refuses it. The control: the victim, back,
/// boots again and gets its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_sniffed_and_used_from_the_victim_s_address_while_it_is_away_gets_no_data() {
    let lab = provisioning_lab().await;
    let intruder = Intruder::join(&lab).await;
    lab.lab.ip(&["link", "set", appliance::BRIDGE, "type", "bridge", "ageing_time", "0"]).unwrap();
    let victim = lab.sims().remove(0);
    let sniffer = Sniffer::start(&intruder.host, mac_bytes(victim.mac()));
    let (victim, victim_token) = provisioning_victim(&lab).await;
    let flooded = sniffer.stop();
    let sniffed =
        flooded.iter().any(|f| contains(f, format!("siteboot.token={victim_token}").as_bytes()));
    assert!(
        sniffed,
        "the victim's token did not reach the intruder: the test did not make the attack it means to"
    );

    let address = victim.address().expect("the victim's leased address");
    victim.set_link(false).unwrap();
    let impostor = intruder.impersonate(address);
    let planted = Spoil::NamingTheVictim(mac_bytes(victim.mac()));
    let refusal = impostor.assert_gets_nothing_without_arp(&lab, planted, &victim, &victim_token);
    assert!(refusal.contains("not confirmed"), "refused for another reason: {refusal:?}");

    impostor.host.ns.ip(&["addr", "flush", "dev", ClientHost::IFACE]).unwrap();
    victim.set_link(true).unwrap();
    victim.reboot();
    let token = wait_token(&victim, Some(&victim_token)).await;
    let (status, data) = victim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, data.as_str()), (200, SECRET));
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
    /// The thread sending [`Spoil::NamingTheVictim`]'s ARPs, and its stop flag.
    announcer: Mutex<Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>>,
}

impl Intruder {
    /// The same machine at `address` instead of its own (another's, taken while it is away).
    fn impersonate(self, address: Ipv4Addr) -> Self {
        let iface = ClientHost::IFACE;
        self.host.ns.ip(&["addr", "flush", "dev", iface]).unwrap();
        self.host.ns.ip(&["addr", "add", &format!("{address}/24"), "dev", iface]).unwrap();
        Self { address, ..self }
    }

    async fn join(lab: &ProviderLab) -> Self {
        let mut object = Host::new("intruder", HostSpec::new(INTRUDER_MAC));
        object.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
        lab.hosts().create(&PostParams::default(), &object).await.unwrap();
        let host = ClientHost::attach(&lab.lab, appliance::BRIDGE, INTRUDER_MAC).unwrap();
        let mut dhcp = Udhcpc::start(&host, &[]).unwrap();
        let lease = dhcp.wait_bound(Duration::from_secs(60)).unwrap();
        // The address stays on the interface; port 68 is free for the forged exchanges.
        dhcp.kill();
        let base_url = lab.siteboot.base_url().to_owned();
        Self { host, address: lease.address.unwrap(), base_url, announcer: Mutex::default() }
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

    /// Gives its lease back and takes the same address for the victim's MAC with a forged
    /// REQUEST, which siteboot ACKs: the lease for the address now names the victim.
    fn take_lease_of(&self, victim: &SimHost) {
        // Without the release, the address is the intruder's lease and the REQUEST is NAKed.
        let mut release = vec![53, 1, DHCP_RELEASE, 54, 4];
        release.extend_from_slice(&SERVER.octets());
        let release = bootp(INTRUDER_MAC, self.address, &[&release]);
        self.send(0, SocketAddrV4::new(SERVER, 67), release, false);
        // RENEWING: ciaddr set, so the ACK comes back unicast to the intruder's port 68.
        let request = bootp(victim.mac(), self.address, &[&[53, 1, DHCP_REQUEST]]);
        let reply = self.send(68, SocketAddrV4::new(SERVER, 67), request, true);
        assert_eq!(
            message_type(&reply.expect("an answer to the forged REQUEST")),
            Some(DHCP_ACK),
            "the forged REQUEST was not ACKed: the test did not make the attack it means to"
        );
    }

    /// [`assert_gets_nothing`](Self::assert_gets_nothing) with each request made while the
    /// appliance's ARP entry for the intruder's address names no one (`how`), on a connection
    /// opened before, and the entry restored to the intruder's MAC before the answer is read
    /// (TCP resends it): the appliance decides from the spoiled entry, the intruder reads.
    fn assert_gets_nothing_without_arp(
        &self,
        lab: &ProviderLab,
        how: Spoil,
        victim: &SimHost,
        victim_token: &str,
    ) -> String {
        let http: std::net::SocketAddr =
            self.base_url.trim_start_matches("http://").trim_end_matches('/').parse().unwrap();
        let mut stream =
            self.host.ns.enter(move || Ok(std::net::TcpStream::connect(http)?)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        self.spoil_arp(lab, how);
        let request = format!("GET /boot/{}.ipxe HTTP/1.0\r\n\r\n", mac_dashed(victim.mac()));
        stream.write_all(request.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        self.restore_arp(how);
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (head, script) = response.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{response}");
        let stolen = script
            .split_whitespace()
            .find_map(|w| w.strip_prefix("siteboot.token="))
            .map(str::to_owned);
        let token = stolen.as_deref().unwrap_or(victim_token);

        // The bootstrap data over HTTPS: curl sends the request's head, then its (chunked,
        // ignored) body only once the entry is spoiled; the agent API reads the body before it
        // asks who holds the address.
        let agent = sim::ramdisk_cmdline(script).unwrap().agent;
        let mut curl = self.host.ns.command("curl");
        curl.args(["-sS", "-k", "--http1.1", "--max-time", "60", "-X", "GET", "-T", "-"])
            .args(["-H", "Expect:", "-H", &format!("Authorization: Bearer {token}")])
            .args(["-o", "-", "-w", "\n%{http_code}"])
            .arg(format!("{agent}/agent/v1/bootstrap"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut curl = curl.spawn().unwrap();
        std::thread::sleep(Duration::from_secs(2));
        self.spoil_arp(lab, how);
        let mut body = curl.stdin.take().unwrap();
        body.write_all(b"{}").unwrap();
        drop(body);
        std::thread::sleep(Duration::from_secs(2));
        self.restore_arp(how);
        let out = curl.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&out.stdout);
        let (data, status) = out.rsplit_once('\n').unwrap();
        assert!(
            stolen.is_none() && status.trim() == "403",
            "the intruder at {} got a token: {stolen:?}; bootstrap answered {status}: {data:?}",
            self.address
        );
        assert!(!data.contains("abcdef.0123456789abcdef"), "the join secret leaked");
        data.to_owned()
    }

    /// Leaves the appliance's ARP entry for the intruder's address naming no one.
    fn spoil_arp(&self, lab: &ProviderLab, how: Spoil) {
        match how {
            Spoil::ZeroMac => self.gratuitous_arp([0; 6]),
            Spoil::Unanswered => {
                self.arp_ignore(8); // answer no ARP request
                // The entry a real intruder lets age out (stale, then failed when probes go
                // unanswered): gone now, then incomplete while the appliance asks in vain.
                let address = self.address.to_string();
                lab.lab.ip(&["neigh", "del", &address, "dev", appliance::BRIDGE]).unwrap();
            }
            Spoil::NamingTheVictim(victim) => {
                self.arp_ignore(8);
                let stop = Arc::new(AtomicBool::new(false));
                let (flag, address) = (stop.clone(), self.address);
                let socket = self.host.ns.enter(|| packet_socket(libc::ETH_P_ARP, false)).unwrap();
                let thread = std::thread::spawn(move || {
                    while !flag.load(Ordering::Acquire) {
                        send_gratuitous_arp(&socket, address, victim).unwrap();
                        std::thread::sleep(Duration::from_millis(50));
                    }
                });
                *self.announcer.lock().unwrap() = Some((stop, thread));
            }
        }
        let address = self.address.to_string();
        let spoiled = siteboot_tests::wait::until(
            "the appliance's ARP entry to be spoiled",
            Duration::from_secs(5),
            Duration::from_millis(50),
            || {
                let mut show = lab.lab.command("ip");
                let entry = siteboot_tests::netns::output(show.args(["neigh", "show", &address]));
                let entry = entry.unwrap();
                let spoiled = match how {
                    Spoil::NamingTheVictim(victim) => {
                        let victim: Vec<String> =
                            victim.iter().map(|b| format!("{b:02x}")).collect();
                        entry.contains(&format!("lladdr {}", victim.join(":")))
                    }
                    Spoil::ZeroMac | Spoil::Unanswered => {
                        !entry.contains("lladdr") || entry.contains("lladdr 00:00:00:00:00:00")
                    }
                };
                spoiled.then_some(())
            },
        );
        spoiled.expect("the test did not make the attack it means to");
    }

    fn restore_arp(&self, how: Spoil) {
        if let Some((stop, thread)) = self.announcer.lock().unwrap().take() {
            stop.store(true, Ordering::Release);
            thread.join().unwrap();
        }
        if how != Spoil::ZeroMac {
            self.arp_ignore(0);
        }
        self.gratuitous_arp(mac_bytes(INTRUDER_MAC));
    }

    /// Gives the lease [`take_lease_of`](Self::take_lease_of) took back (a RELEASE from its
    /// address) and the address with it.
    fn release_lease_of(&self, victim: &SimHost) {
        let mut release = vec![53, 1, DHCP_RELEASE, 54, 4];
        release.extend_from_slice(&SERVER.octets());
        let release = bootp(victim.mac(), self.address, &[&release]);
        self.send(0, SocketAddrV4::new(SERVER, 67), release, false);
        self.host.ns.ip(&["addr", "flush", "dev", ClientHost::IFACE]).unwrap();
    }

    fn arp_ignore(&self, value: u8) {
        let setting = format!("net.ipv4.conf.{}.arp_ignore={value}", ClientHost::IFACE);
        siteboot_tests::netns::run(self.host.ns.command("sysctl").args(["-qw", &setting])).unwrap();
    }

    /// Broadcasts a gratuitous ARP request for the intruder's address with `sender` as its
    /// hardware address, from a packet socket in the intruder's namespace: what any machine on
    /// the segment can send.
    fn gratuitous_arp(&self, sender: [u8; 6]) {
        let address = self.address;
        self.host
            .ns
            .enter(move || {
                send_gratuitous_arp(&packet_socket(libc::ETH_P_ARP, false)?, address, sender)
            })
            .unwrap();
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

/// How the intruder spoils the appliance's ARP entry for its address: naming no one, or the
/// victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spoil {
    /// A gratuitous ARP with an all-zero sender MAC.
    ZeroMac,
    /// No answer to the appliance's ARP requests.
    Unanswered,
    /// Gratuitous ARPs with this (the victim's) sender MAC from the intruder's own Ethernet
    /// address, every 50 ms, and no answer to ARP requests.
    NamingTheVictim([u8; 6]),
}

/// Frames to one MAC that reach a machine of the segment: a packet socket in its namespace.
struct Sniffer {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Vec<u8>>>,
}

impl Sniffer {
    fn start(host: &ClientHost, to: [u8; 6]) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (fd, _) = host.ns.enter(|| packet_socket(libc::ETH_P_ALL, true)).unwrap();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut frames = Vec::new();
            let mut buf = vec![0u8; 65536];
            while !flag.load(Ordering::Acquire) {
                // SAFETY: recv into a buffer this thread owns, on a descriptor it owns.
                let n =
                    unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n >= 14 && buf[..6] == to {
                    let frame = buf[..n as usize].to_vec();
                    let text = String::from_utf8_lossy(&frame);
                    if let Some(word) =
                        text.split_whitespace().find(|w| w.starts_with("siteboot.token="))
                    {
                        eprintln!("sniffed a frame to the victim's MAC carrying {word}");
                    }
                    frames.push(frame);
                }
            }
            frames
        });
        Self { stop, thread }
    }

    /// Every frame to the MAC seen since the start.
    fn stop(self) -> Vec<Vec<u8>> {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap()
    }
}

/// A packet socket for `protocol`, and the index of the namespace's `eth0` (asked in the
/// namespace); with `receive`, bound to it with a 100 ms receive timeout.
fn packet_socket(protocol: libc::c_int, receive: bool) -> anyhow::Result<(OwnedFd, i32)> {
    let protocol = (protocol as u16).to_be();
    let interface = std::ffi::CString::new(ClientHost::IFACE).unwrap();
    // SAFETY: reads the NUL-terminated name, which outlives the call.
    let ifindex = unsafe { libc::if_nametoindex(interface.as_ptr()) } as i32;
    anyhow::ensure!(ifindex > 0, "no {}: {}", ClientHost::IFACE, std::io::Error::last_os_error());
    // SAFETY: plain socket calls; the descriptor is owned at once, the structs outlive the calls.
    unsafe {
        let fd = libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW,
            if receive { protocol.into() } else { 0 },
        );
        anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let fd = OwnedFd::from_raw_fd(fd);
        if receive {
            let mut at: libc::sockaddr_ll = std::mem::zeroed();
            at.sll_family = libc::AF_PACKET as u16;
            at.sll_protocol = protocol;
            at.sll_ifindex = ifindex;
            let len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            let bound = libc::bind(fd.as_raw_fd(), (&at as *const libc::sockaddr_ll).cast(), len);
            anyhow::ensure!(bound == 0, "bind: {}", std::io::Error::last_os_error());
            let timeout = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
            let size = std::mem::size_of::<libc::timeval>() as u32;
            let set = libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                size,
            );
            anyhow::ensure!(set == 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        }
        Ok((fd, ifindex))
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Broadcasts, on the packet socket `fd` and its namespace's `eth0`, a gratuitous ARP request for
/// `address` with `sender` as its hardware address, from the intruder's own Ethernet address.
fn send_gratuitous_arp(
    (fd, ifindex): &(OwnedFd, i32),
    address: Ipv4Addr,
    sender: [u8; 6],
) -> anyhow::Result<()> {
    let mut frame = vec![0xff; 6]; // to everyone
    frame.extend_from_slice(&mac_bytes(INTRUDER_MAC));
    // ARP, Ethernet/IPv4, a request: sender, then target (the same address).
    frame.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    frame.extend_from_slice(&sender);
    frame.extend_from_slice(&address.octets());
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&address.octets());
    // SAFETY: sendto with buffers that outlive the call, on a descriptor the caller owns.
    unsafe {
        let mut to: libc::sockaddr_ll = std::mem::zeroed();
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_protocol = (libc::ETH_P_ARP as u16).to_be();
        to.sll_ifindex = *ifindex;
        to.sll_halen = 6;
        to.sll_addr[..6].fill(0xff);
        let sent = libc::sendto(
            fd.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&to as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        );
        anyhow::ensure!(
            sent == frame.len() as isize,
            "sendto: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

fn mac_bytes(mac: &str) -> [u8; 6] {
    let mut bytes = [0; 6];
    for (byte, hex) in bytes.iter_mut().zip(mac.split(':')) {
        *byte = u8::from_str_radix(hex, 16).unwrap();
    }
    bytes
}

/// A BOOTREQUEST from `mac` with `ciaddr` and the given options (each `[code, len, value..]`).
fn bootp(mac: &str, ciaddr: Ipv4Addr, options: &[&[u8]]) -> Vec<u8> {
    let mut p = vec![0u8; 236];
    p[0] = 1; // BOOTREQUEST
    p[1] = 1; // Ethernet
    p[2] = 6;
    p[4..8].copy_from_slice(&0x5eed_0001u32.to_be_bytes());
    p[12..16].copy_from_slice(&ciaddr.octets());
    p[28..34].copy_from_slice(&mac_bytes(mac));
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
