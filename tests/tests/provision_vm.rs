//! Issues 9 and 23's proof: whole machines provisioned end to end, through Redfish only. QEMU
//! (TCG) VMs with empty raw disks, driven by sushy-tools' Redfish emulator, run the real deploy
//! ramdisk (`scripts/build-ramdisk`: the agent of `images/agent`) and get an image from siteboot
//! in Kubernetes mode:
//!
//! registered (BMC checked) -> powered on, network boot, inspected by the ramdisk (MAC, disk
//! sizes, system UUID on the Host) -> Available -> claimed by a MachineDeployment -> the image
//! (from the appliance's cache) and a NoCloud seed with the bootstrap data written -> the VM
//! boots its disk -> its Machine deleted -> wiped (the disk files hold no partition table or
//! signature) -> Host deleted -> powered off.
//!
//! One lab (one management cluster that is also the workers' workload cluster, with its
//! controller manager and scheduler, prepared for `kubeadm join`; the CAPI core, kubeadm
//! bootstrap and kubeadm control plane managers; one libvirt + sushy-tools) for every VM:
//!
//! - `workers`: a BIOS VM and a UEFI (OVMF) VM, the two hosts of a MachineDeployment of 2 with
//!   siteboot's bootstrap provider, get the node image: each joins as a Node with the Host's
//!   providerID. A Deployment's pod runs on one; that worker's Machine is deleted, the Node is
//!   drained and the pod comes back on the other; a MachineHealthCheck replaces the other, which
//!   is powered off behind Cluster API's back, on a wiped host. With the spare deleted, the
//!   MachineDeployment is rolled out to kubeadm's bootstrap provider with `maxSurge: 0`: its
//!   host is wiped, imaged again and joins with `kubeadm join`, and siteboot gives the Node its
//!   providerID by the system UUID. The appliance is killed once while a ramdisk writes the
//!   image and once while one wipes.
//! - `two-disks`: a UEFI VM with two disks whose Host's root device hints pick the second (the
//!   first stays byte for byte as it was) gets the test OS, which prints the provider ID it read
//!   and runs the cluster's bootstrap Secret (a script).
//! - `failures`: a BIOS VM goes through what fails: an unreachable BMC, an image that does not
//!   match its sha256, a ramdisk that dies during an operation.
//! - `control-plane`: the default flavor, as `clusterctl generate cluster` makes it from
//!   siteboot's template, on a BIOS VM and the `bios` worker: its KubeadmControlPlane claims the
//!   first host, which is imaged with the node image and runs `kubeadm init` with nothing
//!   pulled, keepalived holding the endpoint; KCP Available, the Node Ready in that workload
//!   cluster with the Host's providerID. The flavor's worker Machine then claims `bios`, which
//!   SitebootConfig's data joins to that cluster, and a pod runs there. The Cluster is deleted,
//!   both hosts wiped; `bios` then serves `workers`. It runs before `workers`: two cores do not
//!   run a TCG control plane and two imaging workers at once.
//!
//! The two-disk VM boots from virtual media (`spec.bootMethod: VirtualMedia`, issue 22 item
//! 3): each operation's ramdisk comes in an ISO the emulator fetches from the appliance and
//! inserts, with the token inside. It sits on a routed segment of its own (`br1`), where
//! another DHCP server (dnsmasq) leases its address and siteboot's DHCP and ARP do not reach:
//! the agent knows its ramdisk by the token alone. Every packet to or from that VM on its
//! segment is captured (all but the image's bulk), and none holds a token the VM booted with.
//!
//! Failures panic while the lab is alive, so the VM consoles and the appliance's log get
//! printed.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use sha2::Digest;
use siteboot_controller::conditions::BMC_READY;
use siteboot_controller::crd::{
    Bmc, BootMethod, BootMode, Host, HostSpec, HostState, OperationKind, RootDeviceHints,
    SITE_LABEL, condition,
};
use siteboot_controller::host::lifecycle::{FORCE_DELETE_ANNOTATION, RETRY_ANNOTATION};
use siteboot_tests::appliance;
use siteboot_tests::clients::{Dnsmasq, PacketCapture};
use siteboot_tests::kube::Peers;
use siteboot_tests::kube::bootstrap;
use siteboot_tests::kube::capi::{CAPI, wait_gone, wait_object};
use siteboot_tests::kube::clusterctl::{Clusterctl, apply};
use siteboot_tests::kube::node::{
    CHECKLIST, KubeletOn, NodeImage, WORKLOAD_IMAGE, checklist, joined_checklist,
    ready_and_matched, workload_deployment,
};
use siteboot_tests::os_images;
use siteboot_tests::provider::{NS, ProviderLab, SITE, host_state, until_host, wait_host};
use siteboot_tests::redfish::{Domain, Libvirt, Machine, Sushy, SushyOptions};
use siteboot_tests::timeline::Timeline;
use siteboot_tests::vm::Firmware;

const USER: (&str, &str) = ("admin", "correct horse");
const CLUSTER: &str = "e2e";
/// The bootstrap data: a script, so the test OS runs it and prints its exit code.
const BOOTSTRAP: &str = "#!/bin/sh\necho \"user-data on $(hostname)\"\nexit 7\n";
const USER_DATA_EXIT: &str = "siteboot-test-os: user-data exit=7";
/// Labels a Host so only its own scenario's MachineDeployment claims it.
const VM_LABEL: &str = "e2e.siteboot.dev/vm";
/// The MachineDeployment (and its templates) of the node hosts, and their Hosts' [`VM_LABEL`].
const WORKERS: &str = "workers";
/// The worker the appliance is killed under while its ramdisk writes the image.
const CRASHED_WHILE_IMAGING: &str = "uefi";
/// The workload's Deployment, and its pods' `app` label.
const WORKLOAD: &str = "workload";
/// One network boot plus an operation under TCG, four VMs sharing two cores: a few minutes.
const PHASE_TIMEOUT: Duration = Duration::from_secs(12 * 60);
const POWER_TIMEOUT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;
/// How long a ramdisk may say nothing during an operation: far longer than a TCG ramdisk takes
/// from its boot script to its first call, short enough to wait for in the failure scenario.
const SILENCE: Duration = Duration::from_secs(150);
/// How much of a failed scenario's consoles its failure message quotes.
const CONSOLE_LINES: usize = 25;
/// The failure scenario's Host, domain, template and MachineDeployment.
const FAILURES: &str = "failures";
/// The default flavor's workload cluster (`clusterctl generate cluster`): one control-plane
/// host, the scenario [`CONTROL_PLANE`] (its Host and domain too), and one worker.
const FLAVOR_CLUSTER: &str = "edge";
const CONTROL_PLANE: &str = "control-plane";
/// The label the flavor's SitebootMachineTemplates select hosts by, and its two values there
/// (the template's defaults).
const ROLE_LABEL: &str = "siteboot.dev/role";
const CONTROL_PLANE_ROLE: &str = "control-plane";
const WORKER_ROLE: &str = "worker";
/// The flavor's control-plane endpoint: a free address on the lab's segment, outside the DHCP
/// pool, which keepalived holds on the control-plane host.
const ENDPOINT: &str = "10.99.0.250";
/// From the flavor's apply to KubeadmControlPlane Available: the claim, the imaging, the first
/// boot and `kubeadm init` under TCG (about 4.5 minutes here; development runs took up to 10).
const CONTROL_PLANE_TIMEOUT: Duration = Duration::from_secs(25 * 60);
const KCP_API: &str = "controlplane.cluster.x-k8s.io/v1beta2";
/// The control-plane VM's CPU weight (see `Libvirt::favour`): ahead of the small test-OS VMs
/// that boot beside it, and of the other tests CI runs at the same time. Development runs
/// without it, with workers imaging beside it, saw its etcd and apiserver miss their deadlines.
const CONTROL_PLANE_NICE: i32 = -10;
/// How many journal lines a failure's error quotes (of cloud-init's commands, of a unit).
const JOURNAL_LINES: usize = 40;

/// One VM's run through the whole lifecycle.
struct Scenario {
    /// Host and domain name; the template's and MachineDeployment's too, unless a worker.
    name: &'static str,
    mac: &'static str,
    firmware: Firmware,
    disks_mib: &'static [u64],
    hints: Option<RootDeviceHints>,
    /// The disk the image must land on (index into `disks_mib`).
    root: usize,
    /// `spec.bmc.bootMode` (sushy-tools sets the domain's firmware to match it).
    boot_mode: Option<BootMode>,
    boot_method: BootMethod,
    /// The bridge of its segment: the appliance's ([`appliance::BRIDGE`]), or the routed one.
    bridge: &'static str,
    os: Os,
    /// Its Host's [`ROLE_LABEL`]: which of the default flavor's pools may claim it.
    role: Option<&'static str>,
}

/// What a scenario's host runs once provisioned.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Os {
    /// The test OS with the cluster's bootstrap Secret (a script): it prints what it read and
    /// powers off.
    Test,
    /// The node image with SitebootConfig bootstrap data, as one of the [`WORKERS`]: it joins
    /// the workload cluster, its Node gets the Host's providerID from the meta-data and runs
    /// pods, and its Machine's deletion drains it before the host is wiped.
    Node,
    /// The node image with the default flavor's KubeadmControlPlane data: `kubeadm init`, with
    /// the control plane's images from the image and keepalived holding [`ENDPOINT`].
    ControlPlane,
}

impl Scenario {
    /// Its Host's [`VM_LABEL`], which its MachineDeployment's template selects.
    fn pool(&self) -> &'static str {
        match self.os {
            Os::Test | Os::ControlPlane => self.name,
            Os::Node => WORKERS,
        }
    }
}

/// The routed segment: its own bridge and subnet, dnsmasq handing out addresses with the lab's
/// namespace as the router to the appliance's subnet.
const ROUTED_BRIDGE: &str = "br1";
const ROUTED_GATEWAY: &str = "10.98.0.1";
const ROUTED_RANGE: &str = "10.98.0.100,10.98.0.150,255.255.255.0,1h";

fn scenarios() -> [Scenario; 4] {
    [
        // The node image (1.5 GiB) on a larger disk: the agent grows its root partition.
        Scenario {
            name: "bios",
            mac: "52:54:00:00:09:01",
            firmware: Firmware::Bios,
            disks_mib: &[3072],
            hints: None,
            root: 0,
            boot_mode: Some(BootMode::Legacy),
            boot_method: BootMethod::Network,
            bridge: appliance::BRIDGE,
            os: Os::Node,
            // The default flavor's worker first, then one of the workers.
            role: Some(WORKER_ROLE),
        },
        Scenario {
            name: "uefi",
            mac: "52:54:00:00:09:02",
            firmware: Firmware::Uefi,
            disks_mib: &[3072],
            hints: None,
            root: 0,
            boot_mode: Some(BootMode::Uefi),
            boot_method: BootMethod::Network,
            bridge: appliance::BRIDGE,
            os: Os::Node,
            role: None,
        },
        // Without the hint the agent would take the smaller disk that holds the image: vda.
        // UEFI: OVMF tries each disk in boot order; SeaBIOS boots only the first hard disk.
        Scenario {
            name: "two-disks",
            mac: "52:54:00:00:09:03",
            firmware: Firmware::Uefi,
            disks_mib: &[512, 1024],
            hints: Some(RootDeviceHints { name: Some("/dev/vdb".into()), ..Default::default() }),
            root: 1,
            boot_mode: None,
            boot_method: BootMethod::VirtualMedia,
            bridge: ROUTED_BRIDGE,
            os: Os::Test,
            role: None,
        },
        // Room for the control plane's images, imported at its first boot, and etcd's data.
        Scenario {
            name: CONTROL_PLANE,
            mac: "52:54:00:00:09:05",
            firmware: Firmware::Bios,
            disks_mib: &[4096],
            hints: None,
            root: 0,
            boot_mode: Some(BootMode::Legacy),
            boot_method: BootMethod::Network,
            bridge: appliance::BRIDGE,
            os: Os::ControlPlane,
            role: Some(CONTROL_PLANE_ROLE),
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vms_are_inspected_provisioned_wiped_and_powered_off_through_redfish() {
    let ramdisk = os_images::ramdisk(None).unwrap();
    let os = os_images::test_os_image().unwrap();
    let node = NodeImage::build(&Peers::locate().unwrap()).unwrap();
    let mut lab = ProviderLab::start(0, |config| {
        config["kubernetes"]["ramdisk_silence_timeout"] = json!(format!("{}s", SILENCE.as_secs()));
        config["kubernetes"]["ramdisk_media"] = json!(ramdisk.iso);
    })
    .await
    .unwrap();
    // The workload cluster's CSR approval and signing, Deployments and scheduling.
    lab.env.start_control_plane().await.unwrap();
    lab.env.start_kubeadm_providers().await.unwrap();
    lab.install_ramdisk(&ramdisk).unwrap();
    let image = lab.serve_image("test-os", &os).unwrap();
    let node_image =
        lab.serve_image_file("node.raw.zst", &node.compressed(), &node.sha256).unwrap();
    let resets = ResetRule::image_downloads(&lab.lab, RESET_EVERY).unwrap();
    lab.lab.add_bridge(ROUTED_BRIDGE, &format!("{ROUTED_GATEWAY}/24")).unwrap();
    let routed_dhcp = Dnsmasq::start(
        &lab.lab,
        ROUTED_BRIDGE,
        &[format!("--dhcp-range={ROUTED_RANGE}"), format!("--dhcp-option=3,{ROUTED_GATEWAY}")],
    )
    .unwrap();
    // The machine's lock is held from here: the route below is this lab's alone.
    let libvirt = Libvirt::start(&lab.lab).unwrap();
    // Cluster API's managers run on the machine and reach the flavor's control plane there.
    lab.lab.route_from_machine(ENDPOINT).unwrap();
    let sushy =
        Sushy::start(SushyOptions { user: USER, tls: None, netns: Some(&lab.lab) }).unwrap();
    lab.create_cluster(CLUSTER, BOOTSTRAP).await.unwrap();
    lab.env.prepare_kubeadm_join(&lab.lab, appliance::ADDRESS, NS, CLUSTER).await.unwrap();
    let clusterctl_dir = tempfile::tempdir().unwrap();
    let flavor = flavor(&lab, &node_image, clusterctl_dir.path()).unwrap();

    let scenarios = scenarios();
    let timelines: Vec<Timeline> = scenarios.iter().map(|_| Timeline::start()).collect();
    let env = Env {
        timelines: scenarios.iter().map(|s| s.mac).zip(&timelines).collect(),
        lab: &lab,
        libvirt: &libvirt,
        sushy: &sushy,
        image: &image,
        os: &os.disk,
        node_image: &node_image,
        node: &node,
        routed_dhcp: &routed_dhcp,
        flavor: &flavor,
    };
    let of = |os: Os| scenarios.iter().zip(&timelines).filter(move |(s, _)| s.os == os);
    let control = of(Os::ControlPlane).next().expect("a control plane");
    let (flavor_worker, worker) = match of(Os::Node).collect::<Vec<_>>()[..] {
        [a, b] if a.0.role == Some(WORKER_ROLE) => (a, b),
        _ => panic!("two workers, the first the flavor's"),
    };
    let alone = of(Os::Test)
        .map(|(s, timeline)| timed(s.name, run(&env, s, timeline)))
        .chain([timed(FAILURES, failures(&env))]);
    // The flavor's cluster first, then the workers: two cores run one TCG control plane and one
    // imaging and joining worker, not two of them beside it (docs/testing.md).
    let in_turn = async {
        let (name, result, took) =
            timed(CONTROL_PLANE, control_plane(&env, control, flavor_worker)).await;
        let (control, workers) = match result {
            Ok(vm) => {
                let (a, a_timeline) = flavor_worker;
                let run = workers_run(&env, (a, vm, a_timeline), worker);
                (Ok(()), timed(WORKERS, run).await)
            }
            Err(e) => {
                let not_run = anyhow!("not run: {CONTROL_PLANE} failed first");
                (Err(e), (WORKERS, Err(not_run), Duration::ZERO))
            }
        };
        vec![(name, control, took), workers]
    };
    let (alone, in_turn) = tokio::join!(futures_util::future::join_all(alone), in_turn);
    let results: Vec<_> = alone.into_iter().chain(in_turn).collect();
    let mut failed = Vec::new();
    for (name, result, took) in &results {
        match result {
            Ok(()) => eprintln!("scenario {name}: passed in {took:.0?}"),
            Err(e) => failed.push(format!("scenario {name}: FAILED after {took:.0?}: {e:#}")),
        }
    }
    // Each host's timeline; a failed scenario's hosts first, with their consoles' last lines,
    // in the panic's message: a CI log that keeps only the failure's neighbourhood still shows
    // where those hosts' boots stopped.
    let in_failed = |s: &Scenario| {
        results.iter().any(|(name, result, _)| {
            let worker_in = |scenario| *name == scenario && s.role == Some(WORKER_ROLE);
            result.is_err()
                && (*name == s.name
                    || (*name == WORKERS && s.os == Os::Node)
                    || worker_in(CONTROL_PLANE))
        })
    };
    let (first, then): (Vec<_>, Vec<_>) =
        scenarios.iter().zip(&timelines).partition(|(s, _)| in_failed(s));
    let report: Vec<String> = first
        .into_iter()
        .chain(then)
        .map(|(s, t)| {
            let mut text = t.render(s.name, &lab.siteboot.timeline(s.mac).unwrap_or_default());
            if in_failed(s) {
                let console = libvirt.domain(s.name).map(|d| d.console_tail(CONSOLE_LINES));
                text +=
                    &format!("\nthe end of {}'s console:\n{}", s.name, console.unwrap_or_default());
            }
            text
        })
        .collect();
    eprintln!("{}", report.join("\n"));
    if !failed.is_empty() {
        eprintln!("{}", lab.describe().await);
        panic!("{}\n{}", failed.join("\n"), report.join("\n"));
    }
    // Every Machine was deleted: nothing of theirs is left (the Hosts stay, as inventory).
    let leftovers = lab.leftovers().await.unwrap();
    assert!(leftovers.is_empty(), "left behind: {leftovers:#?}");
    // Each of the three images written (128 MiB or more) was cut twice and resumed.
    let cut = resets.count().unwrap();
    eprintln!("image downloads reset mid-stream: {cut}");
    assert!(cut >= 6, "only {cut} image downloads were reset: the resume went untested");
}

/// A scenario's run, named and timed (they run at once, in one task).
fn timed<'a, T: 'a>(
    name: &'a str,
    run: impl std::future::Future<Output = Result<T>> + 'a,
) -> futures_util::future::LocalBoxFuture<'a, (&'a str, Result<T>, Duration)> {
    Box::pin(async move {
        let started = Instant::now();
        (name, run.await, started.elapsed())
    })
}

/// Every connection from the VMs to the appliance's HTTP port is reset once the appliance has
/// sent it this much: the ramdisk's image download breaks off mid-stream, more than once.
/// (iPXE's kernel and initrd, less than this, pass.)
const RESET_EVERY: u64 = 48 * MIB;

/// An iptables rule in the lab's namespace that answers the packets it matches with a TCP
/// reset, and counts them.
struct ResetRule<'a> {
    ns: &'a siteboot_tests::netns::Netns,
    /// The rule's comment, which finds it in the listing.
    name: &'static str,
}

impl<'a> ResetRule<'a> {
    fn add(
        ns: &'a siteboot_tests::netns::Netns,
        name: &'static str,
        matching: &[&str],
    ) -> Result<Self> {
        let mut args = vec!["-I", "INPUT"];
        args.extend(matching);
        args.extend(["-m", "comment", "--comment", name, "-j", "REJECT"]);
        args.extend(["--reject-with", "tcp-reset"]);
        siteboot_tests::netns::run(ns.command("iptables").args(&args))?;
        Ok(Self { ns, name })
    }

    /// Every connection from the VMs (on either segment) to the appliance's HTTP port, once the
    /// appliance has sent it `bytes`: the ramdisk's image download breaks off mid-stream.
    fn image_downloads(ns: &'a siteboot_tests::netns::Netns, bytes: u64) -> Result<Self> {
        let (port, from) = (appliance::HTTP_PORT.to_string(), format!("{bytes}:"));
        Self::add(
            ns,
            "image-downloads",
            &[
                "!",
                "-i",
                "lo",
                "-p",
                "tcp",
                "--dport",
                &port,
                "-m",
                "connbytes",
                "--connbytes",
                &from,
                "--connbytes-dir",
                "reply",
                "--connbytes-mode",
                "bytes",
            ],
        )
    }

    /// Every connection attempt to `port` on the namespace's loopback (what the kernel does
    /// anyway when nothing listens there, but counted).
    fn connections_to(
        ns: &'a siteboot_tests::netns::Netns,
        name: &'static str,
        port: u16,
    ) -> Result<Self> {
        let port = port.to_string();
        Self::add(ns, name, &["-i", "lo", "-p", "tcp", "--dport", &port, "--syn"])
    }

    /// How many packets the rule answered with a reset.
    fn count(&self) -> Result<u64> {
        let listed = siteboot_tests::netns::output(
            self.ns.command("iptables").args(["-L", "INPUT", "-v", "-x", "-n"]),
        )?;
        let comment = format!("/* {} */", self.name);
        let line = listed.lines().find(|l| l.contains(&comment)).context("no such rule")?;
        let packets = line.split_whitespace().next().context("no packet count")?;
        Ok(packets.parse()?)
    }
}

/// What every scenario shares.
struct Env<'a> {
    /// Each scenario's timeline, by its VM's MAC.
    timelines: Vec<(&'a str, &'a Timeline)>,
    lab: &'a ProviderLab,
    /// The DHCP server of the routed segment.
    routed_dhcp: &'a Dnsmasq,
    libvirt: &'a Libvirt,
    sushy: &'a Sushy,
    /// The SitebootMachine `image` that writes the test OS.
    image: &'a Value,
    /// The test OS image's file.
    os: &'a Path,
    /// The SitebootMachine `image` that writes the node image.
    node_image: &'a Value,
    node: &'a NodeImage,
    /// The default flavor's cluster: the documents `clusterctl generate cluster` printed, as
    /// [`flavor`] edits them.
    flavor: &'a [Value],
}

/// A VM registered as a Host and inspected: Available.
struct Vm {
    domain: Domain,
    /// Its packets on its segment, if the scenario checks where its tokens went.
    capture: Option<PacketCapture>,
    /// The disks the root device hints rule out, with their sha256 before the claim.
    others: Vec<(usize, String)>,
}

/// Defines `s`'s VM and registers its Host (the BMC checked, powered on with a network boot);
/// returns once the ramdisk inspected it and the Host is Available with its hardware.
async fn inspected(env: &Env<'_>, s: &Scenario, timeline: &Timeline) -> Result<Vm> {
    let (memory_mib, cpus) = match s.os {
        Os::Test => (512, 1),
        Os::Node => (2048, 2),
        Os::ControlPlane => (3072, 2),
    };
    let machine = Machine { firmware: s.firmware, disks_mib: s.disks_mib, memory_mib, cpus };
    let domain = env.libvirt.define_with(s.name, s.mac, s.bridge, &machine)?;
    // All the VM's packets on the segment but the bulk of the files (full-size segments from
    // the HTTP port, except each response's first: its headers and the start of its body, all
    // of a boot script's first try): where a token in clear would be. The BIOS VM's network
    // boots are the control: the capture must see their tokens.
    let capture = (s.boot_method == BootMethod::VirtualMedia || s.name == "bios")
        .then(|| {
            let filter = format!(
                "ether host {} and (not (tcp src port {} and greater 1400) \
                 or tcp[((tcp[12:1] & 0xf0) >> 2):4] = 0x48545450)",
                s.mac,
                appliance::HTTP_PORT
            );
            PacketCapture::start(&env.lab.lab, s.bridge, &filter)
        })
        .transpose()?;
    // A disk the hints rule out must never be written: mark it, and compare it later.
    let others: Vec<(usize, String)> = (0..s.disks_mib.len())
        .filter(|i| *i != s.root)
        .map(|i| {
            mark(&domain.disks[i])?;
            Ok((i, sha256_file(&domain.disks[i])?))
        })
        .collect::<Result<_>>()?;

    let hosts = env.lab.hosts();
    let mut host = Host::new(s.name, HostSpec::new(s.mac));
    let mut labels = BTreeMap::from([
        (SITE_LABEL.to_owned(), SITE.to_owned()),
        (VM_LABEL.to_owned(), s.pool().to_owned()),
    ]);
    if let Some(role) = s.role {
        labels.insert(ROLE_LABEL.to_owned(), role.to_owned());
    }
    host.metadata.labels = Some(labels);
    let address = env.sushy.address(&domain);
    host.spec.bmc = Some(Bmc {
        credentials_name: env.lab.bmc_credentials(s.name, &address, USER).await?,
        address,
        certificate_fingerprint: None,
        boot_mode: s.boot_mode,
    });
    host.spec.root_device_hints = s.hints.clone();
    host.spec.boot_method = s.boot_method;
    hosts.create(&PostParams::default(), &host).await?;
    timeline.mark("Host created (its BMC checked, then powered on with a network boot)");
    let host = wait_host(&hosts, s.name, "Available", PHASE_TIMEOUT, |h| {
        host_state(h) == Some(HostState::Available)
    })
    .await
    .map_err(|e| with_console(e, &domain))?;
    timeline.mark("inspected by the ramdisk: Available");
    let status = host.status.clone().unwrap_or_default();
    let bmc = condition(&status.conditions, BMC_READY).map(|c| (c.status.clone(), &c.reason));
    ensure!(bmc == Some(("True".into(), &"BMCReachable".into())), "BMCReady: {bmc:?}");
    let hardware = status.hardware.context("no hardware on the inspected Host")?;
    let uuid = hardware.system.as_ref().map(|s| s.uuid.to_ascii_lowercase());
    ensure!(uuid.as_deref() == Some(domain.uuid.as_str()), "system UUID {uuid:?}");
    ensure!(
        hardware.nics.iter().any(|n| n.mac.eq_ignore_ascii_case(s.mac)),
        "no NIC with {} in {:?}",
        s.mac,
        hardware.nics
    );
    let mut disks: Vec<(String, u64)> =
        hardware.disks.iter().map(|d| (d.name.clone(), d.size_bytes)).collect();
    disks.sort();
    let want: Vec<(String, u64)> = s
        .disks_mib
        .iter()
        .enumerate()
        .map(|(i, mib)| (format!("/dev/vd{}", char::from(b'a' + i as u8)), mib * MIB))
        .collect();
    ensure!(disks == want, "disks {disks:?}, want {want:?}");
    Ok(Vm { domain, capture, others })
}

/// A test OS scenario: its own MachineDeployment of 1 with the cluster's bootstrap Secret; the
/// test OS runs it; scaled to 0, the host is wiped, then deleted (or, booted from virtual
/// media, left powered off with the media ejected).
async fn run(env: &Env<'_>, s: &Scenario, timeline: &Timeline) -> Result<()> {
    let vm = inspected(env, s, timeline).await?;
    let data = json!({ "bootstrap": { "dataSecretName": format!("{CLUSTER}-bootstrap") } });
    let spec =
        json!({ "image": env.image, "hostSelector": { "matchLabels": { VM_LABEL: s.name } } });
    env.lab.create_template_spec(s.name, spec).await?;
    env.lab.create_machine_deployment_with(NS, s.name, CLUSTER, s.name, 1, data).await?;
    timeline.mark("MachineDeployment of 1 created");
    test_os_ran(&vm.domain, &provider_id(s)).await?;
    timeline.mark("first boot of the disk: the test OS ran the data");
    // The test OS powers off after its last line.
    wait_domain(env.libvirt, &vm.domain, "shut off").await?;
    provisioned(env, s, &vm, env.os).await?;

    env.lab.scale(s.name, 0).await?;
    timeline.mark("scaled to 0");
    wiped(env, s, &vm, None, timeline).await?;
    match &vm.capture {
        Some(capture) if s.boot_method == BootMethod::VirtualMedia => {
            media_only(&vm.domain, capture)?;
            // The media ejected, the wiped host is powered off: no stale ramdisk left running.
            wait_domain(env.libvirt, &vm.domain, "shut off").await?;
            timeline.mark("media ejected, powered off");
            Ok(())
        }
        _ => deleted(env, s, &vm.domain, timeline).await,
    }
}

/// The default flavor as a user generates it: `clusterctl generate cluster` from the release's
/// template (the committed one, which `clusterctl.rs` checks is what siteboot writes), with one
/// control-plane machine, one worker, [`ENDPOINT`] and the node image; then [`slow_machine`],
/// and the workers' SitebootConfigTemplate given [`node_config`] (the checks' labels, taint and
/// shortest token lifetime).
fn flavor(lab: &ProviderLab, node_image: &Value, dir: &Path) -> Result<Vec<Value>> {
    let release = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/clusterctl/infrastructure-siteboot")
        .join(format!("v{}", env!("CARGO_PKG_VERSION")));
    let clusterctl =
        Clusterctl::new(&lab.env, dir, &release.join("infrastructure-components.yaml"))?;
    let template = release.join("cluster-template.yaml");
    let version = lab.env.kubernetes_version()?;
    let (url, checksum) = (
        node_image["url"].as_str().context("the node image's url")?,
        node_image["checksum"].as_str().context("the node image's checksum")?,
    );
    let mut generated = clusterctl.generate_cluster(
        FLAVOR_CLUSTER,
        &[
            "--from",
            template.to_str().context("a UTF-8 path")?,
            "--target-namespace",
            NS,
            "--kubernetes-version",
            &version,
            "--control-plane-machine-count",
            "1",
            "--worker-machine-count",
            "1",
        ],
        &[
            ("SITEBOOT_CONTROL_PLANE_ENDPOINT_HOST", ENDPOINT),
            ("SITEBOOT_IMAGE_URL", url),
            ("SITEBOOT_IMAGE_CHECKSUM", checksum),
        ],
    )?;
    for object in &mut generated {
        if object["kind"] == "KubeadmControlPlane" {
            slow_machine(&mut object["spec"]["kubeadmConfigSpec"]);
        } else if object["kind"] == "SitebootConfigTemplate" {
            object["spec"]["template"]["spec"] = node_config();
        }
    }
    Ok(generated)
}

/// Where [`slow_machine`]'s kubeadm patches are written on the control-plane host.
const PATCHES: &str = "/etc/kubernetes/siteboot-test-patches";

/// What a control plane under TCG on two shared cores needs and one on real hardware does not
/// (docs/air-gapped.md): kubeadm's waits raised, and the static pods' probes relaxed by kubeadm
/// patches (with kubeadm's defaults the kubelet restarted the apiserver before it first
/// answered). Added to the generated KubeadmControlPlane's `kubeadmConfigSpec`.
fn slow_machine(spec: &mut Value) {
    let timeouts = json!({
        "controlPlaneComponentHealthCheckSeconds": 1200,
        "kubernetesAPICallSeconds": 900,
        "etcdAPICallSeconds": 900,
    });
    for configuration in ["initConfiguration", "joinConfiguration"] {
        spec[configuration]["timeouts"] = timeouts.clone();
        spec[configuration]["patches"] = json!({ "directory": PATCHES });
    }
    let files = spec["files"].as_array_mut().expect("the flavor writes files");
    for component in ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"] {
        let patch = json!({ "spec": { "containers": [{
            "name": component,
            "startupProbe": { "failureThreshold": 120, "timeoutSeconds": 30 },
            "livenessProbe": { "failureThreshold": 30, "timeoutSeconds": 30 },
        }] } });
        files.push(json!({
            "path": format!("{PATCHES}/{component}+strategic.json"),
            "content": patch.to_string(),
        }));
    }
}

/// The default flavor on two hosts, `s` and the worker `w` (inspected beside it): the
/// generated cluster applied, its KubeadmControlPlane claims `s`, which is imaged with the node
/// image and runs `kubeadm init` from KCP's data with nothing pulled; keepalived holds
/// [`ENDPOINT`] on it. KCP becomes Available; the workload cluster's kubeconfig (KCP's Secret,
/// through the endpoint) lists the host's Node, Ready, with the Host's providerID, and its
/// Machine is Running with it as nodeRef. The flavor's worker Machine then claims `w`, which
/// SitebootConfig's data joins to that cluster ([`joined`]), and a pod runs there. The Cluster
/// is then deleted: both hosts are wiped and Available again, and `s`'s Host deleted. Returns
/// `w`'s VM, Available for the workers.
async fn control_plane(
    env: &Env<'_>,
    (s, timeline): (&Scenario, &Timeline),
    (w, w_timeline): (&Scenario, &Timeline),
) -> Result<Vm> {
    let (vm, w_vm) =
        futures_util::try_join!(inspected(env, s, timeline), inspected(env, w, w_timeline))?;
    // Whichever QEMU the BMC started last: the host's boots, the ramdisk's and its disk's.
    let favoured = async {
        loop {
            let _ = env.libvirt.favour(&vm.domain, CONTROL_PLANE_NICE);
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    };
    tokio::select! {
        result = control_plane_run(env, (s, &vm, timeline), (w, &w_vm, w_timeline)) => result?,
        () = favoured => unreachable!("favours until the run ends"),
    }
    Ok(w_vm)
}

/// [`control_plane`]'s steps once the hosts are inspected.
async fn control_plane_run(
    env: &Env<'_>,
    (s, vm, timeline): (&Scenario, &Vm, &Timeline),
    (w, w_vm, w_timeline): (&Scenario, &Vm, &Timeline),
) -> Result<()> {
    let console_from = vm.domain.console().lines().count();
    let applied = apply(&env.lab.env, NS, env.flavor).await?;
    timeline.mark(&format!("the flavor applied: {}", applied.join(", ")));
    let kcps = env.lab.env.api(KCP_API, "KubeadmControlPlane", Some(NS));
    let kcp = format!("{FLAVOR_CLUSTER}-control-plane");
    let available = siteboot_tests::wait::for_async(
        "the KubeadmControlPlane to be Available",
        CONTROL_PLANE_TIMEOUT,
        || async { kcps.get(&kcp).await.ok().filter(|o| condition_true(o, "Available")) },
    );
    let available = tokio::select! {
        available = available => available,
        failed = cloud_init_failed(&vm.domain, console_from) => Err(failed),
    };
    if let Err(e) = available {
        let status = kcps.get(&kcp).await.map(|o| o.data["status"].to_string());
        return Err(with_console(e.context(format!("its status: {status:?}")), &vm.domain));
    }
    timeline.mark("KubeadmControlPlane Available");

    let edge = Workload::of_cluster(env, FLAVOR_CLUSTER).await?;
    let nodes: Api<Node> = Api::all(edge.client.clone());
    let provider_id = self::provider_id(s);
    let name = wait_node(&nodes, "a Node with the Host's providerID", POWER_TIMEOUT, |n| {
        n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(provider_id.as_str())
    })
    .await?;
    ready_and_matched(&nodes, &name, POWER_TIMEOUT).await?;
    let machine = claiming_machine(env, s.name).await?;
    machine_running_on(env, &machine.name_any(), &name).await?;
    timeline.mark("its Node Ready in the workload cluster, with the Host's providerID");

    // The flavor's worker: claimed once the control plane was initialized (its data waits for
    // that), joined by SitebootConfig's data with a token siteboot made in this cluster.
    let join = Join { crash: false, console_from: 0 };
    let w_node = joined(env, &edge, w, w_vm, w_timeline, join).await?;
    let deployments: Api<Deployment> = Api::namespaced(edge.client.clone(), edge.namespace);
    let tolerations = json!([{ "key": "dedicated", "value": "ml", "effect": "NoSchedule" }]);
    let deployment = workload_deployment(WORKLOAD, tolerations);
    deployments.create(&PostParams::default(), &deployment).await?;
    workload_running(&edge, Some(&w_node)).await?;
    w_timeline.mark("the Deployment's pod Running on the Node, in the flavor's cluster");

    let clusters = env.lab.env.api(CAPI, "Cluster", Some(NS));
    clusters.delete(FLAVOR_CLUSTER, &DeleteParams::default()).await?;
    for timeline in [timeline, w_timeline] {
        timeline.mark("Cluster deleted");
    }
    futures_util::try_join!(
        wiped(env, s, vm, None, timeline),
        wiped(env, w, w_vm, None, w_timeline)
    )?;
    // Nothing of the flavor's is left to claim the worker's host again.
    wait_gone(&clusters, FLAVOR_CLUSTER, POWER_TIMEOUT).await?;
    deleted(env, s, &vm.domain, timeline).await
}

/// Returns an error once `domain`'s console (after its first `from` lines) shows a checklist
/// whose cloud-init did not end `done` (its bootstrap data failed, which no wait need outlast),
/// with the last lines cloud-init's commands printed in the journal (kubeadm's error among them).
async fn cloud_init_failed(domain: &Domain, from: usize) -> anyhow::Error {
    loop {
        // No checklist yet: the data is still running.
        let Ok(line) = wait_console(domain, from, &[CHECKLIST]).await else { continue };
        let ended = checklist(&line).get("cloud-init").cloned().unwrap_or_default();
        if ended == "done" {
            return std::future::pending().await;
        }
        let printed = journal_tail(domain, "cloud-init[");
        return anyhow!(
            "{}'s cloud-init ended {ended:?}: {line}\nthe last of what it printed:\n{printed}",
            domain.name
        );
    }
}

/// The last [`JOURNAL_LINES`] lines of `domain`'s journal that contain `pattern`.
fn journal_tail(domain: &Domain, pattern: &str) -> String {
    let lines = domain.journal_lines(pattern);
    lines[lines.len().saturating_sub(JOURNAL_LINES)..].join("\n")
}

/// Fails unless the checklist `line` of `domain`'s console is a joined host's
/// ([`joined_checklist`]), with the journal's last lines naming each item that differs (a
/// unit's name: a failed unit's own error is among them).
fn joined_as_expected(domain: &Domain, line: &str) -> Result<()> {
    let (found, expected) = (checklist(line), joined_checklist(KubeletOn::Host));
    let differing: Vec<String> = expected
        .iter()
        .filter(|(item, value)| found.get(*item) != Some(value))
        .map(|(item, _)| {
            format!("the journal's lines with {item:?}:\n{}", journal_tail(domain, item))
        })
        .collect();
    ensure!(differing.is_empty(), "the node's checklist: {line}\n{}", differing.join("\n"));
    Ok(())
}

/// Whether `object`'s status has condition `kind` True.
fn condition_true(object: &DynamicObject, kind: &str) -> bool {
    let conditions = object.data["status"]["conditions"].as_array();
    conditions.is_some_and(|c| c.iter().any(|c| c["type"] == kind && c["status"] == "True"))
}

/// A cluster the workers join, where the test reads their Nodes and runs its pod: the
/// management cluster as [`CLUSTER`]'s hosted control plane, or the default flavor's.
struct Workload {
    /// An admin kubeconfig's text, with its user's credentials inline.
    kubeconfig: String,
    client: kube::Client,
    /// Where the test's Deployment runs.
    namespace: &'static str,
}

impl Workload {
    /// The management cluster, which is [`CLUSTER`]'s workload cluster too.
    fn hosted(env: &Env<'_>) -> Self {
        let kube = &env.lab.env;
        Self {
            kubeconfig: kube.admin_kubeconfig().to_owned(),
            client: kube.client(),
            namespace: NS,
        }
    }

    /// `cluster`'s, by the kubeconfig its control plane provider wrote (`<cluster>-kubeconfig`),
    /// whose server must be [`ENDPOINT`].
    async fn of_cluster(env: &Env<'_>, cluster: &str) -> Result<Self> {
        let secrets: Api<Secret> = Api::namespaced(env.lab.env.client(), NS);
        let secret = secrets.get(&format!("{cluster}-kubeconfig")).await?;
        let text = bootstrap::secret_text(&secret, "value");
        let parsed = kube::config::Kubeconfig::from_yaml(&text)?;
        let server = parsed.clusters.first().and_then(|c| c.cluster.as_ref()?.server.clone());
        let want = format!("https://{ENDPOINT}:6443");
        ensure!(server.as_deref() == Some(want.as_str()), "the kubeconfig's server: {server:?}");
        let config = kube::Config::from_custom_kubeconfig(parsed, &Default::default()).await?;
        let client = kube::Client::try_from(config)?;
        Ok(Self { kubeconfig: text, client, namespace: "default" })
    }
}

/// The two workers, `a` (inspected before, and Available again after serving the default
/// flavor's cluster) and `b`: one MachineDeployment of 2 with a SitebootConfigTemplate claims
/// both hosts, and each joins [`CLUSTER`] (hosted by the management cluster) as a Node. A
/// Deployment's pod runs on one of them; that worker's Machine is deleted (chosen with Cluster
/// API's delete-machine annotation, the MachineDeployment scaled to 1): its Node is drained and
/// the pod comes back on the other Node; its host is wiped and Available again, its Host kept.
/// A MachineHealthCheck then replaces the other worker, powered off behind Cluster API's back;
/// the spare Host is deleted, the MachineDeployment rolled out to kubeadm's bootstrap provider
/// on the one host left ([`kubeadm_rollout`]), then scaled to 0: drained, wiped, and that Host
/// deleted too.
async fn workers_run(
    env: &Env<'_>,
    (a, a_vm, a_timeline): (&Scenario, Vm, &Timeline),
    (b, b_timeline): (&Scenario, &Timeline),
) -> Result<()> {
    let b_vm = inspected(env, b, b_timeline).await?;
    let hosted = Workload::hosted(env);
    let config = bootstrap::create_config_template(&env.lab.env, NS, WORKERS, node_config());
    let config = json!({ "bootstrap": config.await? });
    let spec = json!({ "image": env.node_image, "hostSelector": { "matchLabels": { VM_LABEL: WORKERS } } });
    env.lab.create_template_spec(WORKERS, spec).await?;
    env.lab.create_machine_deployment_with(NS, WORKERS, CLUSTER, WORKERS, 2, config).await?;
    for timeline in [a_timeline, b_timeline] {
        timeline.mark("MachineDeployment of 2 created");
    }
    let join = |s: &Scenario| Join { crash: s.name == CRASHED_WHILE_IMAGING, console_from: 0 };
    // `a`'s console already holds the checklist of its join to the flavor's cluster.
    let a_join = Join { console_from: a_vm.domain.console().lines().count(), ..join(a) };
    let (a_node, b_node) = futures_util::try_join!(
        joined(env, &hosted, a, &a_vm, a_timeline, a_join),
        joined(env, &hosted, b, &b_vm, b_timeline, join(b))
    )?;

    // A Deployment's pod, placed by the scheduler on either Node.
    let deployments: Api<Deployment> = Api::namespaced(hosted.client.clone(), hosted.namespace);
    let tolerations = json!([{ "key": "dedicated", "value": "ml", "effect": "NoSchedule" }]);
    let deployment = workload_deployment(WORKLOAD, tolerations);
    deployments.create(&PostParams::default(), &deployment).await?;
    let (_, on) = workload_running(&hosted, None).await?;
    let mut workers = [(a, &a_vm, a_timeline, a_node), (b, &b_vm, b_timeline, b_node)];
    if workers[1].3 == on {
        workers.swap(0, 1);
    }
    let [
        (first, first_vm, first_timeline, first_node),
        (second, second_vm, second_timeline, second_node),
    ] = workers;
    first_timeline.mark("the Deployment's pod Running on the Node");

    // That worker's Machine deleted: drained, the pod back on the other Node, the host wiped.
    let machine = claiming_machine(env, first.name).await?;
    let delete =
        json!({ "metadata": { "annotations": { "cluster.x-k8s.io/delete-machine": "" } } });
    let machines = env.lab.api("Machine");
    machines.patch(&machine.name_any(), &PatchParams::default(), &Patch::Merge(&delete)).await?;
    env.lab.scale(WORKERS, 1).await?;
    first_timeline.mark("its Machine chosen for deletion, the MachineDeployment scaled to 1");
    drained(env, &first_node).await?;
    first_timeline.mark("drained: the pod evicted, the Node still there");
    workload_running(&hosted, Some(&second_node)).await?;
    second_timeline.mark("the Deployment's pod Running here, moved from the drained Node");
    crash_during(env, first, "wiping", first_timeline).await?;
    wiped(env, first, first_vm, Some(&first_node), first_timeline).await?;
    let still = env.lab.running_machines(WORKERS).await?;
    let names: Vec<&Value> = still.iter().map(|m| &m.data["status"]["nodeRef"]["name"]).collect();
    ensure!(names == [&json!(second_node)], "the Machines left Running: {names:?}");

    // The other worker's VM powered off behind Cluster API's back (libvirt, not its BMC): the
    // MachineHealthCheck finds its Node unreachable and its Machine is deleted once its host,
    // powered on through its BMC, is wiped; the replacement Machine then gets one of the two
    // hosts, imaged anew, where the pod then runs.
    let workers = [(first, first_vm, first_timeline), (second, second_vm, second_timeline)];
    let console_from = workers.map(|(_, vm, _)| vm.domain.console().lines().count());
    let unhealthy = claiming_machine(env, second.name).await?;
    create_health_check(env).await?;
    env.libvirt.virsh(&["destroy", &second_vm.domain.name])?;
    second_timeline.mark("its VM powered off through libvirt, behind Cluster API's back");
    let remediated = async {
        wait_gone(&machines, &unhealthy.name_any(), PHASE_TIMEOUT).await?;
        second_timeline.mark("its Machine remediated: deleted by the MachineHealthCheck");
        Ok(())
    };
    futures_util::try_join!(
        remediated,
        wiped(env, second, second_vm, Some(&second_node), second_timeline)
    )?;
    let reused = replacement_host(env, [first.name, second.name]).await?;
    let (host, vm, timeline) = workers[reused];
    timeline.mark("claimed by the replacement Machine");
    let join = Join { crash: false, console_from: console_from[reused] };
    let replacement = joined(env, &hosted, host, vm, timeline, join).await?;
    workload_running(&hosted, Some(&replacement)).await?;
    timeline.mark("the Deployment's pod Running on the replacement");

    // The spare goes: the rollout has exactly as many hosts as replicas, so the old Machine's
    // host is the new one's.
    let (spare, spare_vm, spare_timeline) = workers[1 - reused];
    deleted(env, spare, &spare_vm.domain, spare_timeline).await?;
    let kubeadm_node = kubeadm_rollout(env, &hosted, host, vm, timeline, &replacement).await?;

    env.lab.scale(WORKERS, 0).await?;
    timeline.mark("scaled to 0");
    drained(env, &kubeadm_node).await?;
    timeline.mark("drained: the pod evicted, the Node still there");
    wiped(env, host, vm, Some(&kubeadm_node), timeline).await?;
    deleted(env, host, &vm.domain, timeline).await
}

/// The workers' MachineDeployment rolled out to kubeadm's bootstrap provider (CABPK), with
/// `maxSurge: 0` on its one host: the old Machine is drained and deleted first and its host
/// wiped; then the new Machine claims that same host, which is imaged again and joins with
/// `kubeadm join` (the control plane prepared for it as `kubeadm init` would, see
/// `siteboot_tests::kube::kubeadm`). Nothing gives that kubelet a provider-id: siteboot sets the
/// Node's providerID, found by the system UUID the ramdisk read. The pod then runs there.
/// Returns the new Node's name.
async fn kubeadm_rollout(
    env: &Env<'_>,
    hosted: &Workload,
    s: &Scenario,
    vm: &Vm,
    timeline: &Timeline,
    old_node: &str,
) -> Result<String> {
    let kube = &env.lab.env;
    let old = claiming_machine(env, s.name).await?;
    let console_from = vm.domain.console().lines().count();
    let machine = kube.create_kubeadm_config_template(NS, "workers-kubeadm", "kubeadm", false);
    let machine = machine.await?;
    let rollout = json!({ "spec": {
        "rollout": { "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": { "maxSurge": 0, "maxUnavailable": 1 },
        } },
        "template": { "spec": machine },
    }});
    let deployments = env.lab.api("MachineDeployment");
    deployments.patch(WORKERS, &PatchParams::default(), &Patch::Merge(&rollout)).await?;
    timeline.mark("rolled out to kubeadm's bootstrap provider (maxSurge 0, no spare host)");
    drained(env, old_node).await?;
    timeline.mark("drained: the pod evicted, the Node still there");
    wiped(env, s, vm, Some(old_node), timeline).await?;
    wait_gone(&env.lab.api("Machine"), &old.name_any(), POWER_TIMEOUT).await?;
    kubeadm_joined(env, hosted, s, vm, timeline, console_from).await
}

/// The host claimed by a Machine with CABPK's data, imaged, and joined with `kubeadm join`;
/// the Node gets its providerID from siteboot by the VM's system UUID, the Machine its nodeRef,
/// and the workload's pod runs there. Returns the Node's name.
async fn kubeadm_joined(
    env: &Env<'_>,
    hosted: &Workload,
    s: &Scenario,
    vm: &Vm,
    timeline: &Timeline,
    console_from: usize,
) -> Result<String> {
    let kube = &env.lab.env;
    let machine = claiming_machine(env, s.name).await?;
    let config_ref = &machine.data["spec"]["bootstrap"]["configRef"];
    ensure!(config_ref["kind"] == "KubeadmConfig", "the new Machine's bootstrap: {config_ref}");
    timeline.mark("claimed by the rolled-out Machine (kubeadm bootstrap)");
    let secret = machine.data["spec"]["bootstrap"]["dataSecretName"].as_str().unwrap_or_default();
    let data = Api::<Secret>::namespaced(kube.client(), NS).get(secret).await?;
    let data = bootstrap::secret_text(&data, "value");
    ensure!(data.contains("kubeadm join"), "not kubeadm's bootstrap data:\n{data}");
    ensure!(!data.contains("provider-id") && !data.contains("provider_id"), "{data}");

    let line = wait_console(&vm.domain, console_from, &[CHECKLIST]);
    let line = line.await.map_err(|e| with_console(e, &vm.domain))?;
    timeline.mark("first boot of the disk: cloud-init ran kubeadm join");
    joined_as_expected(&vm.domain, &line)?;
    let provider_id = provider_id(s);
    let nodes: Api<Node> = Api::all(kube.client());
    let name = wait_node(&nodes, "a Node with the VM's system UUID", PHASE_TIMEOUT, |n| {
        let info = n.status.as_ref().and_then(|s| s.node_info.as_ref());
        info.is_some_and(|i| i.system_uuid.eq_ignore_ascii_case(&vm.domain.uuid))
    })
    .await?;
    let node = ready_and_matched(&nodes, &name, PHASE_TIMEOUT).await?;
    timeline.mark("Node Ready, matched to its Machine");
    let set = node.spec.as_ref().and_then(|s| s.provider_id.as_deref());
    ensure!(set == Some(provider_id.as_str()), "the Node's providerID: {set:?}");
    // Who wrote it: not the kubelet (it had no provider-id), but siteboot's patch.
    let writers: Vec<&str> = node
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|f| f.fields_v1.as_ref().is_some_and(|v| v.0.to_string().contains("f:providerID")))
        .filter_map(|f| f.manager.as_deref())
        .collect();
    ensure!(!writers.is_empty() && !writers.contains(&"kubelet"), "providerID by {writers:?}");
    machine_running_on(env, &machine.name_any(), &name).await?;
    workload_running(hosted, Some(&name)).await?;
    timeline.mark("the Deployment's pod Running on the kubeadm-joined Node");
    Ok(name)
}

/// Which of `hosts` the next Machine claims: the remediated one's replacement may get either
/// wiped host (the reuse policy: its own order over the Available ones).
async fn replacement_host(env: &Env<'_>, hosts: [&str; 2]) -> Result<usize> {
    let api = env.lab.hosts();
    siteboot_tests::wait::for_async("a host claimed by the replacement", PHASE_TIMEOUT, || async {
        for (i, name) in hosts.iter().enumerate() {
            if api.get(name).await.ok()?.spec.consumer_ref.is_some() {
                return Some(i);
            }
        }
        None
    })
    .await
}

/// A MachineHealthCheck for the workers: a Node unreachable (Ready Unknown) for 20 s is
/// unhealthy; a new Machine's Node may take as long as imaging under TCG does.
async fn create_health_check(env: &Env<'_>) -> Result<()> {
    let check: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineHealthCheck",
        "metadata": { "name": WORKERS },
        "spec": {
            "clusterName": CLUSTER,
            "selector": { "matchLabels": { "pool": WORKERS } },
            "checks": {
                "nodeStartupTimeoutSeconds": 2 * PHASE_TIMEOUT.as_secs(),
                "unhealthyNodeConditions": [
                    { "type": "Ready", "status": "Unknown", "timeoutSeconds": 20 },
                ],
            },
        },
    }))?;
    env.lab.api("MachineHealthCheck").create(&PostParams::default(), &check).await?;
    Ok(())
}

/// `siteboot://<namespace>/<host>`: the providerID of the Machine on `s`'s host.
fn provider_id(s: &Scenario) -> String {
    format!("siteboot://{NS}/{}", s.name)
}

/// How a worker's host gets imaged and joins.
#[derive(Clone, Copy)]
struct Join {
    /// Whether the appliance is killed once while the ramdisk writes the image.
    crash: bool,
    /// The console's lines before this imaging (an earlier one's checklist does not count).
    console_from: usize,
}

/// A worker's host imaged and joined: the Machine that claimed it has its data (one token for
/// its config), the appliance is killed while the ramdisk writes the image if `join.crash`, and
/// the node joins (see [`node_joined`]). Returns its Node's name.
async fn joined(
    env: &Env<'_>,
    workload: &Workload,
    s: &Scenario,
    vm: &Vm,
    timeline: &Timeline,
    join: Join,
) -> Result<String> {
    let machine = claiming_machine(env, s.name).await?;
    let token = bootstrap::machine_token(&env.lab.env, &workload.client, NS, &machine).await?;
    if join.crash {
        crash_during(env, s, "writing image", timeline).await?;
    }
    let console = (&vm.domain, join.console_from);
    let name = machine.name_any();
    let node = node_joined(env, workload, s, &name, console, &token, timeline).await?;
    // Before the ramdisk rebooted, siteboot made the disk the BMC's next boot: the host went
    // there without a network boot (which on UEFI tries PXE and HTTP over IPv6 first).
    let boot = &emulator(env, &vm.domain, "")?["Boot"];
    ensure!(boot["BootSourceOverrideTarget"] == "Hdd", "the BMC's next boot: {boot}");
    provisioned(env, s, vm, &env.node.disk()).await?;
    Ok(node)
}

/// The host is Provisioned with the image on its root disk (and the disks ruled out as they
/// were); on the routed segment, with dnsmasq's address; the capture holds no token it booted
/// with from virtual media, or (the control) those of its network boots.
async fn provisioned(env: &Env<'_>, s: &Scenario, vm: &Vm, written: &Path) -> Result<()> {
    let host = env.lab.hosts().get(s.name).await?;
    ensure!(
        host_state(&host) == Some(HostState::Provisioned),
        "Host state {:?}",
        host_state(&host)
    );
    if s.bridge == ROUTED_BRIDGE {
        routed(env, s, &host)?;
    }
    same_bytes(&vm.domain.disks[s.root], written)?;
    for (i, digest) in &vm.others {
        ensure!(sha256_file(&vm.domain.disks[*i])? == *digest, "disk {i}, ruled out, was written");
    }
    match &vm.capture {
        Some(capture) if s.boot_method == BootMethod::VirtualMedia => {
            media_only(&vm.domain, capture)?;
            // The emulator was made to check the appliance's certificate when it fetched the
            // ISO (and fetched it: a mismatch would have failed the insertion).
            let cd = emulator(env, &vm.domain, "/VirtualMedia/Cd")?;
            ensure!(cd["VerifyCertificate"] == true, "the BMC's CD does not check: {cd}");
            let trusted = emulator(env, &vm.domain, "/VirtualMedia/Cd/Certificates")?;
            let members = trusted["Members"].as_array().map_or(0, Vec::len);
            ensure!(members == 1, "the BMC's CD trusts {members} certificates: {trusted}");
        }
        Some(capture) => {
            let bytes = capture.bytes()?;
            let seen = tokens(&vm.domain.console()).into_iter().any(|t| captured(&bytes, t));
            ensure!(seen, "the control: no token of a network boot is in the capture");
        }
        None => {}
    }
    Ok(())
}

/// Once its Machine is gone: the host wiped and Available again, nothing on its disks, and
/// `node` (if it joined) deleted by Cluster API.
async fn wiped(
    env: &Env<'_>,
    s: &Scenario,
    vm: &Vm,
    node: Option<&str>,
    timeline: &Timeline,
) -> Result<()> {
    wait_host(&env.lab.hosts(), s.name, "wiped and Available", PHASE_TIMEOUT, |h| {
        let status = h.status.as_ref();
        h.spec.consumer_ref.is_none()
            && host_state(h) == Some(HostState::Available)
            && status.is_some_and(|s| !s.wipe_required && s.installed.is_none())
    })
    .await
    .map_err(|e| with_console(e, &vm.domain))?;
    timeline.mark("wiped: Available again");
    for disk in &vm.domain.disks {
        no_signature(disk)?;
    }
    if let Some(node) = node {
        let nodes: Api<Node> = Api::all(env.lab.env.client());
        wait_gone(&nodes, node, POWER_TIMEOUT).await?;
        timeline.mark("Node deleted");
    }
    Ok(())
}

/// The Host deleted: its ramdisk (still running after the wipe) is powered off.
async fn deleted(env: &Env<'_>, s: &Scenario, domain: &Domain, timeline: &Timeline) -> Result<()> {
    let hosts = env.lab.hosts();
    ensure!(env.libvirt.state(domain)? == "running", "the ramdisk should still run");
    hosts.delete(s.name, &DeleteParams::default()).await?;
    siteboot_tests::wait::for_async("the Host to go", POWER_TIMEOUT, || async {
        hosts.get_opt(s.name).await.ok()?.is_none().then_some(())
    })
    .await?;
    wait_domain(env.libvirt, domain, "shut off").await?;
    timeline.mark("Host deleted: powered off");
    Ok(())
}

/// The test OS booted, read its provider ID from the meta-data and ran the bootstrap data.
async fn test_os_ran(domain: &Domain, provider_id: &str) -> Result<()> {
    let outcome = wait_console(domain, 0, &["siteboot-test-os: done", "siteboot-test-os: failed"])
        .await
        .map_err(|e| with_console(e, domain))?;
    let console = domain.console();
    ensure!(outcome.ends_with("done"), "the test OS says {outcome:?}\n{console}");
    let provider_id = format!("siteboot-test-os: provider-id={provider_id}");
    for line in [provider_id.as_str(), USER_DATA_EXIT] {
        ensure!(console.lines().any(|l| l.trim_end() == line), "no {line:?} on the console");
    }
    Ok(())
}

/// The SitebootConfig of the node scenario: labels and taints for its Node, and the shortest
/// token lifetime the CRD allows, which the host's inspection, imaging and first boot outlast.
fn node_config() -> Value {
    json!({
        "nodeLabels": { "example.com/pool": "workers" },
        "nodeTaints": [{ "key": "dedicated", "value": "ml", "effect": "NoSchedule" }],
        "tokenTTLSeconds": 60,
    })
}

/// The Machine whose SitebootMachine claimed Host `host`, once it has its bootstrap data.
async fn claiming_machine(env: &Env<'_>, host: &str) -> Result<DynamicObject> {
    let (hosts, machines) = (env.lab.hosts(), env.lab.api("Machine"));
    siteboot_tests::wait::for_async(
        &format!("the Machine on {host}, with its bootstrap data"),
        POWER_TIMEOUT,
        || async {
            let claim = hosts.get(host).await.ok()?.spec.consumer_ref?;
            let list = machines.list(&ListParams::default()).await.ok()?.items;
            list.into_iter().find(|m| {
                m.data["spec"]["infrastructureRef"]["name"] == json!(claim.name)
                    && m.data["spec"]["bootstrap"]["dataSecretName"].is_string()
            })
        },
    )
    .await
}

/// The node image booted and joined the workload cluster with the SitebootConfig's data:
/// cloud-init ran it (the checklist); the kubelet's client certificate was requested with the
/// bootstrap token after that token's first lifetime (siteboot extended it) and approved and
/// signed; the Node is Ready with the Host's providerID from the meta-data and the config's
/// labels and taints; Cluster API matched it to the Machine (nodeRef, the uninitialized taint
/// removed) and Machine `machine` is Running with it as its nodeRef; the token is then deleted
/// and refused, the config Ready. The checklist is looked for after the console's first
/// `console_from` lines. Returns the Node's name.
async fn node_joined(
    env: &Env<'_>,
    workload: &Workload,
    s: &Scenario,
    machine: &str,
    (domain, console_from): (&Domain, usize),
    token: &bootstrap::MachineToken,
    timeline: &Timeline,
) -> Result<String> {
    let provider_id = provider_id(s);
    let provider_id = provider_id.as_str();
    let line = wait_console(domain, console_from, &[CHECKLIST]);
    let line = line.await.map_err(|e| with_console(e, domain))?;
    timeline.mark("first boot of the disk: cloud-init ran the data, the kubelet joined");
    joined_as_expected(domain, &line)?;
    let client = workload.client.clone();

    let requester = format!("system:bootstrap:{}", token.id);
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let csr = csrs
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|csr| csr.spec.username.as_deref() == Some(requester.as_str()));
    let csr = csr.with_context(|| format!("no CSR from {requester}"))?;
    let status = csr.status.clone().unwrap_or_default();
    let approved = status.conditions.unwrap_or_default().iter().any(|c| c.type_ == "Approved");
    ensure!(approved && status.certificate.is_some(), "the CSR is not approved and signed");
    ensure!(csr.spec.signer_name == "kubernetes.io/kube-apiserver-client-kubelet", "{csr:?}");
    let requested = csr.metadata.creation_timestamp.context("no creation time")?.0.as_second();
    let first_expiration = token.expiration.context("no token in the workload cluster")?;
    ensure!(
        u64::try_from(requested)? > first_expiration,
        "the kubelet joined before its token's first expiration: the extension went untested"
    );

    let nodes: Api<Node> = Api::all(client.clone());
    let name = wait_node(&nodes, "a Node with the Host's providerID", POWER_TIMEOUT, |n| {
        n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(provider_id)
    })
    .await?;
    let node = ready_and_matched(&nodes, &name, PHASE_TIMEOUT).await?;
    timeline.mark("Node Ready, matched to its Machine");
    let labels = node.metadata.labels.unwrap_or_default();
    ensure!(labels.get("example.com/pool").map(String::as_str) == Some("workers"), "{labels:?}");
    let taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
    ensure!(taints.iter().any(|t| t.key == "dedicated" && t.value.as_deref() == Some("ml")));
    machine_running_on(env, machine, &name).await?;

    let tokens: Api<Secret> = Api::namespaced(client.clone(), "kube-system");
    wait_gone(&tokens, &format!("bootstrap-token-{}", token.id), POWER_TIMEOUT).await?;
    bootstrap::wait_token_refused(&workload.kubeconfig, &token.token, POWER_TIMEOUT).await?;
    let configs = env.lab.env.api(bootstrap::BOOTSTRAP, "SitebootConfig", Some(NS));
    let config = configs.get(&token.config).await?;
    ensure!(bootstrap::condition(&config, "Ready").0 == json!("True"), "the config is not Ready");

    Ok(name)
}

/// The name of a Node `matches` picks, once there is one.
async fn wait_node(
    nodes: &Api<Node>,
    what: &str,
    timeout: Duration,
    matches: impl Fn(&Node) -> bool,
) -> Result<String> {
    siteboot_tests::wait::for_async(what, timeout, || async {
        let list = nodes.list(&Default::default()).await.ok()?.items;
        list.into_iter().find(|n| matches(n)).and_then(|n| n.metadata.name)
    })
    .await
}

/// Waits for `machine` to be Running with `node` as its nodeRef.
async fn machine_running_on(env: &Env<'_>, machine: &str, node: &str) -> Result<()> {
    let machines = env.lab.api("Machine");
    wait_object(&machines, machine, "Running with its Node as nodeRef", POWER_TIMEOUT, |m| {
        m.data["status"]["phase"] == "Running" && m.data["status"]["nodeRef"]["name"] == json!(node)
    })
    .await
    .map(drop)
}

/// The workload Deployment's pod once one is Running and ready (on `node`, if given), not
/// being deleted; returns its name and Node. No registry is reachable: its sandbox (pause) and
/// its container come from the images node-images.service loaded; its address from the image's
/// bridge CNI.
async fn workload_running(workload: &Workload, node: Option<&str>) -> Result<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(workload.client.clone(), workload.namespace);
    let lp = ListParams::default().labels(&format!("app={WORKLOAD}"));
    let what = format!("the {WORKLOAD} pod Running on {}", node.unwrap_or("a Node"));
    let pod = siteboot_tests::wait::for_async(&what, PHASE_TIMEOUT, || async {
        let list = pods.list(&lp).await.ok()?.items;
        list.into_iter().find(|p| {
            let on = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
            let status = p.status.clone().unwrap_or_default();
            let ready = status.container_statuses.unwrap_or_default().iter().all(|c| c.ready);
            p.metadata.deletion_timestamp.is_none()
                && node.is_none_or(|n| on == Some(n))
                && status.phase.as_deref() == Some("Running")
                && ready
        })
    })
    .await?;
    let on = pod.spec.and_then(|s| s.node_name).context("a Running pod with no Node")?;
    let status = pod.status.unwrap_or_default();
    let images: Vec<String> =
        status.container_statuses.unwrap_or_default().into_iter().map(|c| c.image).collect();
    ensure!(images == [WORKLOAD_IMAGE], "the pod runs {images:?}");
    let ip = status.pod_ip.unwrap_or_default();
    ensure!(ip.starts_with("10.244."), "the pod's address {ip:?} is not the CNI's");
    Ok((pod.metadata.name.unwrap_or_default(), on))
}

/// The appliance is killed (`kill -9`: no shutdown code runs) while the ramdisk of `s`'s host
/// reports `step`, and started again: the ramdisk's operation goes on under the same id and the
/// same token (none minted again), as its next report after the restart shows, or it finished
/// meanwhile and its completion was taken. Every other scenario's ramdisk and BMC requests
/// live through the crash too.
async fn crash_during(env: &Env<'_>, s: &Scenario, step: &str, timeline: &Timeline) -> Result<()> {
    let hosts = env.lab.hosts();
    let at_step = |h: &Host| {
        h.status.as_ref().and_then(|s| s.operation.as_ref()).and_then(|o| o.step.as_deref())
            == Some(step)
    };
    let host =
        until_host(&hosts, s.name, &format!("at step {step:?}"), PHASE_TIMEOUT, at_step).await?;
    let before = host.status.and_then(|s| s.operation).context("no operation")?;
    for (mac, timeline) in &env.timelines {
        timeline.keep_appliance(&env.lab.siteboot, mac);
    }
    env.lab.siteboot.kill9();
    timeline.mark(&format!("appliance killed (kill -9) while the ramdisk is {step}"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let restarted = k8s_openapi::jiff::Timestamp::now();
    env.lab.siteboot.restart()?;
    timeline.mark("appliance restarted");
    let heard_since = |h: &Host| {
        let op = h.status.as_ref().and_then(|s| s.operation.as_ref());
        op.and_then(|o| o.last_heard.as_ref()).is_some_and(|t| t.0 > restarted)
    };
    let host =
        until_host(&hosts, s.name, "the ramdisk heard after the restart", PHASE_TIMEOUT, |h| {
            heard_since(h) || h.status.as_ref().is_some_and(|s| s.operation.is_none())
        })
        .await?;
    let status = host.status.unwrap_or_default();
    let Some(after) = status.operation else {
        // It finished during the restart: the completion it sent with the token it booted
        // with was taken after the restart.
        ensure!(
            status.state != Some(HostState::Quarantined),
            "the operation failed across the restart: {:?}",
            status.quarantine_reason
        );
        return Ok(());
    };
    ensure!(
        (&after.id, &after.token_hash) == (&before.id, &before.token_hash),
        "the operation {} (token {:?}) became {} (token {:?}) across the restart",
        before.id,
        before.token_hash,
        after.id,
        after.token_hash
    );
    Ok(())
}

/// Cluster API drained Node `node` before the host was wiped: its pod was evicted while the
/// Node was still registered (the pod garbage collector removes pods only once their Node is
/// gone).
async fn drained(env: &Env<'_>, node: &str) -> Result<()> {
    let client = env.lab.env.client();
    let (pods, nodes) = (Api::<Pod>::namespaced(client.clone(), NS), Api::<Node>::all(client));
    let pod = siteboot_tests::wait::for_async("the pod evicted", PHASE_TIMEOUT, || async {
        let pod_left = pods
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .any(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node));
        let node_left = nodes.get_opt(node).await.ok()?.is_some();
        (!pod_left).then_some(node_left)
    })
    .await?;
    ensure!(pod, "the Node went before its pod: deleted, not drained");
    Ok(())
}

/// What goes wrong, on one BIOS VM: a BMC that does not answer (a clear condition, nothing
/// powered, then the fixed address goes on), an image that does not match its sha256
/// (Quarantined with the reason, nothing written, nothing booted), and a ramdisk that dies
/// during an operation (Quarantined as silent once the timeout passes).
async fn failures(env: &Env<'_>) -> Result<()> {
    let machine = Machine { firmware: Firmware::Bios, disks_mib: &[512], memory_mib: 512, cpus: 1 };
    let domain =
        env.libvirt.define_with(FAILURES, "52:54:00:00:09:04", appliance::BRIDGE, &machine)?;
    let empty = sha256_file(&domain.disks[0])?;
    let hosts = env.lab.hosts();

    // The BMC's address names a port nothing listens on; each attempt to reach it is counted.
    let port = siteboot_tests::redfish::free_port()?;
    let attempts = ResetRule::connections_to(&env.lab.lab, "dead-bmc", port)?;
    let dead = format!("redfish+http://127.0.0.1:{port}/redfish/v1/Systems/{}", domain.uuid);
    let mut host = Host::new(FAILURES, HostSpec::new(&domain.mac));
    host.metadata.labels = Some(BTreeMap::from([
        (SITE_LABEL.to_owned(), SITE.to_owned()),
        (VM_LABEL.to_owned(), FAILURES.to_owned()),
    ]));
    host.spec.bmc = Some(Bmc {
        credentials_name: env.lab.bmc_credentials(FAILURES, &dead, USER).await?,
        address: dead,
        certificate_fingerprint: None,
        boot_mode: None,
    });
    hosts.create(&PostParams::default(), &host).await?;
    let host = wait_host(&hosts, FAILURES, "BMCReady False", POWER_TIMEOUT, |h| {
        h.status.as_ref().is_some_and(|s| {
            condition(&s.conditions, BMC_READY).is_some_and(|c| c.status == "False")
        })
    })
    .await?;
    let status = host.status.unwrap_or_default();
    let bmc = condition(&status.conditions, BMC_READY).context("no BMCReady")?;
    ensure!(
        bmc.reason == "BMCUnreachable" && bmc.message.contains("unreachable after"),
        "BMCReady: {bmc:?}"
    );
    ensure!(status.state == Some(HostState::Registering), "state {:?}", status.state);
    // Asked again, later and later: in the next 40 s a few more checks (each its bounded
    // attempts), not a loop.
    let per_check: u64 = bmc
        .message
        .split("unreachable after ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .context("no attempt count in the message")?;
    let before = attempts.count()?;
    tokio::time::sleep(Duration::from_secs(40)).await;
    let during = attempts.count()? - before;
    eprintln!("unreachable BMC: {during} connection attempts in 40 s, {per_check} per check");
    ensure!(
        (per_check..=5 * per_check).contains(&during),
        "{during} connection attempts in 40 s, {per_check} per check: want 1 to 5 checks"
    );
    let host = hosts.get(FAILURES).await?;
    ensure!(host_state(&host) == Some(HostState::Registering), "state {:?}", host_state(&host));
    ensure!(env.libvirt.state(&domain)? == "shut off", "powered on through a BMC that failed");
    // The operator gives the BMC's right address to the Secret and the Host.
    let address = env.sushy.address(&domain);
    env.lab.bmc_credentials(FAILURES, &address, USER).await?;
    let fixed = json!({ "spec": { "bmc": { "address": address } } });
    hosts.patch(FAILURES, &PatchParams::default(), &Patch::Merge(&fixed)).await?;
    wait_host(&hosts, FAILURES, "Available", PHASE_TIMEOUT, |h| {
        host_state(h) == Some(HostState::Available)
    })
    .await
    .map_err(|e| with_console(e, &domain))?;

    // Claimed with an image whose sha256 is not the published one.
    let mut image = env.image.clone();
    image["checksum"] = json!(format!("sha256:{:x}", sha2::Sha256::digest(b"another image")));
    let spec = json!({ "image": image, "hostSelector": { "matchLabels": { VM_LABEL: FAILURES } } });
    env.lab.create_template_spec(FAILURES, spec).await?;
    env.lab.create_machine_deployment(FAILURES, CLUSTER, FAILURES, 1).await?;
    let host = until_host(&hosts, FAILURES, "Quarantined", PHASE_TIMEOUT, |h| {
        host_state(h) == Some(HostState::Quarantined)
    })
    .await
    .map_err(|e| with_console(e, &domain))?;
    let reason = host.status.and_then(|s| s.quarantine_reason).unwrap_or_default();
    ensure!(reason.contains("test-os.raw") && reason.contains("discarded"), "reason: {reason}");
    ensure!(sha256_file(&domain.disks[0])? == empty, "the disk was written");
    ensure!(!domain.console().contains("siteboot-test-os"), "an OS booted");

    // Released, then retried: the wipe its claim requires starts, and the VM dies in it.
    env.lab.scale(FAILURES, 0).await?;
    until_host(&hosts, FAILURES, "released", PHASE_TIMEOUT, |h| h.spec.consumer_ref.is_none())
        .await?;
    let retry = json!({ "metadata": { "annotations": { RETRY_ANNOTATION: "" } } });
    hosts.patch(FAILURES, &PatchParams::default(), &Patch::Merge(&retry)).await?;
    until_host(&hosts, FAILURES, "a token for the wipe", PHASE_TIMEOUT, |h| {
        let op = h.status.as_ref().and_then(|s| s.operation.as_ref());
        op.is_some_and(|op| op.kind == OperationKind::Deprovision && op.token_issued.is_some())
    })
    .await
    .map_err(|e| with_console(e, &domain))?;
    env.libvirt.virsh(&["destroy", &domain.name])?;
    let host = until_host(&hosts, FAILURES, "Quarantined", SILENCE + POWER_TIMEOUT, |h| {
        host_state(h) == Some(HostState::Quarantined)
    })
    .await?;
    // The retry ended one quarantine: its annotation is gone, or it would end this one too.
    ensure!(!host.annotations().contains_key(RETRY_ANNOTATION), "the retry annotation stayed");
    let reason = host.status.and_then(|s| s.quarantine_reason).unwrap_or_default();
    ensure!(reason.starts_with("RamdiskSilent:"), "reason: {reason}");

    // Forced out: the test is done with it.
    let force = json!({ "metadata": { "annotations": { FORCE_DELETE_ANNOTATION: "" } } });
    hosts.patch(FAILURES, &PatchParams::default(), &Patch::Merge(&force)).await?;
    hosts.delete(FAILURES, &DeleteParams::default()).await?;
    siteboot_tests::wait::for_async("the Host to go", POWER_TIMEOUT, || async {
        hosts.get_opt(FAILURES).await.ok()?.is_none().then_some(())
    })
    .await
}

/// Waits for the first console line after the first `from` lines containing one of
/// `patterns`; returns it from there. (Async: the scenarios share one task.)
async fn wait_console(domain: &Domain, from: usize, patterns: &[&str]) -> Result<String> {
    siteboot_tests::wait::until_async(
        &format!("{patterns:?} on {}'s console", domain.name),
        PHASE_TIMEOUT,
        Duration::from_secs(1),
        || async {
            domain.console().lines().skip(from).find_map(|line| {
                patterns.iter().find_map(|p| line.find(p).map(|i| line[i..].trim().to_owned()))
            })
        },
    )
    .await
}

async fn wait_domain(libvirt: &Libvirt, domain: &Domain, want: &str) -> Result<()> {
    let what = format!("{} {want}", domain.name);
    siteboot_tests::wait::until_async(&what, POWER_TIMEOUT, Duration::from_secs(1), || async {
        (libvirt.state(domain).ok()? == want).then_some(())
    })
    .await
}

/// The VM booted each operation's ramdisk from virtual media, never from the network, and no
/// token it booted with is in the capture of its packets on the segment.
fn media_only(domain: &Domain, capture: &PacketCapture) -> Result<()> {
    let console = domain.console();
    ensure!(
        console.contains("siteboot-ramdisk: grub"),
        "the ramdisk did not boot from the virtual media's GRUB"
    );
    ensure!(!console.contains("iPXE"), "the VM booted iPXE from the network");
    let tokens = tokens(&console);
    ensure!(!tokens.is_empty(), "no siteboot.token= on the kernel command line");
    let bytes = capture.bytes()?;
    ensure!(bytes.len() > 10_000, "the capture holds {} bytes only", bytes.len());
    for token in tokens {
        ensure!(
            !captured(&bytes, token),
            "a token the VM booted with crossed the segment in clear"
        );
    }
    Ok(())
}

/// The routed VM's ramdisk worked from an address siteboot never leased: dnsmasq's, in the
/// routed subnet, which the Host records as the machine's address.
fn routed(env: &Env<'_>, s: &Scenario, host: &Host) -> Result<()> {
    let leases = env.routed_dhcp.leases();
    let address = leases
        .lines()
        .find(|l| l.split_whitespace().nth(1).is_some_and(|m| m.eq_ignore_ascii_case(s.mac)))
        .and_then(|l| l.split_whitespace().nth(2))
        .with_context(|| format!("dnsmasq leased nothing to {}:\n{leases}", s.mac))?;
    let recorded: Vec<&str> = host
        .status
        .iter()
        .flat_map(|st| &st.addresses)
        .filter(|a| a.kind == "InternalIP")
        .map(|a| a.address.as_str())
        .collect();
    ensure!(recorded == [address], "the Host records {recorded:?}, dnsmasq leased {address}");
    ensure!(address.starts_with("10.98.0."), "{address} is not in the routed subnet");
    Ok(())
}

/// The tokens on the kernel command lines a console shows.
fn tokens(console: &str) -> std::collections::BTreeSet<&str> {
    console.split_whitespace().filter_map(|w| w.strip_prefix("siteboot.token=")).collect()
}

/// Whether `token` is in a capture's bytes.
fn captured(bytes: &[u8], token: &str) -> bool {
    bytes.windows(token.len()).any(|w| w == token.as_bytes())
}

/// What the emulator says at `path` under `domain`'s system, read where it listens (the lab's
/// namespace).
fn emulator(env: &Env<'_>, domain: &Domain, path: &str) -> Result<Value> {
    let system = env.sushy.address(domain).replacen("redfish+http://", "http://", 1);
    let out = siteboot_tests::netns::output(env.lab.lab.command("curl").args([
        "-sf",
        "--max-time",
        "20",
        "-u",
        &format!("{}:{}", USER.0, USER.1),
        &format!("{system}{path}"),
    ]))?;
    Ok(serde_json::from_str(&out)?)
}

/// `error` with the domain's console (the lab prints them all only when the test panics).
fn with_console(error: anyhow::Error, domain: &Domain) -> anyhow::Error {
    domain.print_console();
    error
}

/// Writes a recognisable first MiB on `disk`.
fn mark(disk: &Path) -> Result<()> {
    use std::io::Write;
    let line = b"siteboot e2e: a disk the root device hints rule out\n";
    let mut file = std::fs::OpenOptions::new().write(true).open(disk)?;
    for _ in 0..MIB as usize / line.len() {
        file.write_all(line)?;
    }
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The disk holds the image: byte for byte over its BIOS boot partition and ESP (MiB 1 to 18
/// of scripts/lib/bootable-disk.sh's layout, the test OS's and the node image's), which
/// neither OS writes; its root file system changes once mounted, and the partition tables got
/// the seed.
fn same_bytes(disk: &Path, image: &Path) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let (mut a, mut b) = (std::fs::File::open(disk)?, std::fs::File::open(image)?);
    let (mut x, mut y) = (vec![0; MIB as usize], vec![0; MIB as usize]);
    for mib in 1..18 {
        for (file, buf) in [(&mut a, &mut x), (&mut b, &mut y)] {
            file.seek(SeekFrom::Start(mib * MIB))?;
            file.read_exact(buf)?;
        }
        if x != y {
            bail!("{} differs from the image at MiB {mib}", disk.display());
        }
    }
    Ok(())
}

/// Neither `wipefs` nor `blkid` finds a partition table or signature on `disk`.
fn no_signature(disk: &Path) -> Result<()> {
    let wipefs = Command::new("wipefs").arg("--no-act").arg(disk).output()?;
    let found = String::from_utf8_lossy(&wipefs.stdout);
    ensure!(
        wipefs.status.success() && found.trim().is_empty(),
        "wipefs on {} ({}): {found}{}",
        disk.display(),
        wipefs.status,
        String::from_utf8_lossy(&wipefs.stderr)
    );
    // blkid exits 2 when it finds nothing.
    let blkid = Command::new("blkid").arg("-p").arg(disk).output()?;
    ensure!(
        blkid.status.code() == Some(2),
        "blkid on {} ({}): {}",
        disk.display(),
        blkid.status,
        String::from_utf8_lossy(&blkid.stdout)
    );
    Ok(())
}
