//! Arbitrary datagrams into the DHCP server, full and proxy mode, on ports 67 and 4011. The
//! servers persist across inputs so sequences of messages reach deep lease-table states.

#![no_main]

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, LazyLock, Mutex};

use libfuzzer_sys::fuzz_target;
use siteboot_boot::decision::DhcpMode;
use siteboot_boot::dhcp::leases::LeaseTable;
use siteboot_boot::dhcp::server::{Context, DhcpServer, Port};
use siteboot_boot::dhcp::settings::{NetworkPlan, Settings, SubnetSettings};
use siteboot_boot::inventory::{BootAction, BootRequest, BoxFuture, Inventory, LocalBoot};
use siteboot_boot::metrics::Metrics;
use siteboot_boot::timeline::Timeline;
use siteboot_boot::{Endpoints, MacAddr};
use siteboot_ipxe::IpxeBinaries;

struct BootsEven;
impl Inventory for BootsEven {
    fn boots(&self, mac: MacAddr) -> bool {
        mac.octets()[5] % 2 == 0
    }
    fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
        Box::pin(async { Some(BootAction::LocalDisk(LocalBoot::Exit)) })
    }
}

fn server(mode: DhcpMode) -> Mutex<DhcpServer> {
    let server = Ipv4Addr::new(10, 0, 0, 1);
    let settings = Settings {
        mode,
        subnets: vec![SubnetSettings {
            subnet: "10.0.0.0/24".parse().unwrap(),
            pools: vec!["10.0.0.100-10.0.0.131".parse().unwrap()],
            router: Some(server),
            dns: vec![server],
            domain: Some("fuzz.example".into()),
            lease_time: None,
        }],
        ..Settings::default()
    };
    let dir = std::env::temp_dir().join("siteboot-fuzz-ipxe");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("undionly.kpxe"), b"x").unwrap();
    std::fs::write(dir.join("snponly.efi"), b"x").unwrap();
    let plan = Arc::new(NetworkPlan::new(&settings, server, "dhcp").unwrap());
    let ctx = Context {
        mode,
        endpoints: Endpoints { address: server, http_port: 8080 },
        binaries: Arc::new(IpxeBinaries::discover(&dir)),
        inventory: Arc::new(BootsEven),
        timeline: Arc::new(Timeline::new()),
        metrics: Arc::new(Metrics::new()),
        known_hosts_only: false,
    };
    Mutex::new(DhcpServer::new(ctx, Arc::new(Mutex::new(LeaseTable::new(plan)))))
}

static FULL: LazyLock<Mutex<DhcpServer>> = LazyLock::new(|| server(DhcpMode::Full));
static PROXY: LazyLock<Mutex<DhcpServer>> = LazyLock::new(|| server(DhcpMode::Proxy));

fuzz_target!(|data: &[u8]| {
    let Some((&selector, datagram)) = data.split_first() else { return };
    let server = if selector & 1 == 0 { &FULL } else { &PROXY };
    let port = if selector & 2 == 0 { Port::Dhcp } else { Port::Pxe };
    // Time moves forward in coarse steps so offers and leases expire during a run.
    let now = 1_000_000 + u64::from(selector >> 2) * 600;
    let from = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, selector), 68);
    let outcome = server.lock().unwrap().handle(datagram, from, port, now);
    if let Some(reply) = outcome.reply {
        assert!(reply.bytes.len() >= 300 && reply.bytes.len() <= 1500);
    }
});
