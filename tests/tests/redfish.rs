//! siteboot's Redfish driver against a real Redfish service: sushy-tools' emulator driving
//! libvirt/QEMU (TCG) VMs on a test namespace's bridge (see `siteboot_tests::redfish`). A
//! powered-off VM whose disk is empty is powered on with a one-time network boot, PXE-boots the
//! test ramdisk from the standalone appliance and calls back; identity, power, credentials,
//! certificate pinning, retries and virtual media's certificate check are checked against the
//! same emulator.
//!
//! Failures panic while the lab is alive, so the VM console and daemon logs get printed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_bmc::redfish::protocol::ResetType;
use siteboot_bmc::redfish::retry::RetryPolicy;
use siteboot_bmc::{
    BmcDriver, BmcError, BoundCredentials, Credentials, Identity, Redfish, RedfishAddress,
    RedfishClient,
};
use siteboot_controller::conditions::BMC_READY;
use siteboot_controller::crd::{
    Bmc, BootMode, Host, HostSpec, HostState, PowerState, SITE_LABEL, condition,
};
use siteboot_controller::host::lifecycle::{FORCE_DELETE_ANNOTATION, REBOOT_ANNOTATION};
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::initramfs;
use siteboot_tests::provider::{NS, ProviderLab, SITE};
use siteboot_tests::redfish::{Libvirt, Sushy, SushyOptions, refusing_port};
use siteboot_tests::tls::SelfSigned;
use siteboot_tls_pin::Fingerprint;

const USER: (&str, &str) = ("admin", "correct horse");
/// From power-on to the callback: ~30 s under TCG here; generous for CI.
const BOOT_TIMEOUT: Duration = Duration::from_secs(240);
/// How long a powered-on or powered-off state may take to show.
const POWER_TIMEOUT: Duration = Duration::from_secs(60);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn client(address: &str, password: &str, pin: Option<Fingerprint>) -> RedfishClient {
    let address: RedfishAddress = address.parse().unwrap();
    let credentials = Credentials::new(USER.0, password).unwrap();
    RedfishClient::new(BoundCredentials::trusted(address, pin, credentials)).unwrap()
}

/// Polls the power state until it is `want`.
fn wait_power(rt: &tokio::runtime::Runtime, client: &RedfishClient, want: PowerState) {
    siteboot_tests::wait::until(
        &format!("power {want:?}"),
        POWER_TIMEOUT,
        Duration::from_secs(1),
        || (rt.block_on(client.power()).unwrap() == want).then_some(()),
    )
    .unwrap();
}

#[test]
fn power_on_with_a_one_time_network_boot_boots_the_ramdisk() {
    let mac = "52:54:00:00:03:01";
    let boot = initramfs::boot_files().unwrap();
    let ns = appliance::lab_network("redfish").unwrap();
    let config = appliance::lab_config("full");
    let siteboot = Appliance::start(&ns, config).unwrap();
    siteboot.install_boot_files(&boot).unwrap();
    let libvirt = Libvirt::start(&ns).unwrap();
    let domain = libvirt.define("siteboot-redfish-boot", mac, appliance::BRIDGE).unwrap();
    let sushy = Sushy::start(SushyOptions { user: USER, tls: None, netns: None }).unwrap();
    let rt = runtime();
    let driver = Redfish::new(client(&sushy.address(&domain), USER.1, None));

    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::Off);
    rt.block_on(driver.boot_from_network()).unwrap();
    // sushy-tools takes the override but not its Once: it sets libvirt's boot device for good
    // and reports Continuous. A real BMC clears the override after one boot.
    let boot = rt.block_on(driver.client().boot_override()).unwrap();
    assert_eq!(
        (boot.target.as_deref(), boot.enabled.as_deref()),
        (Some("Pxe"), Some("Continuous")),
        "{boot:?}"
    );
    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::On);

    // The disk is empty: only the network boot reaches the ramdisk's callback.
    let marker = domain.wait_for_console("SITEBOOT-TEST: callback", BOOT_TIMEOUT).unwrap();
    assert_eq!(marker, "SITEBOOT-TEST: callback ok");
    let stages = appliance::stages(&siteboot.timeline(mac).unwrap());
    for stage in ["dhcp-ack", "ipxe-script", "report"] {
        assert!(stages.iter().any(|s| s == stage), "no {stage} in the timeline: {stages:?}");
    }
    // The ramdisk powers off after its callback (ACPI): the BMC sees it; powering off what is
    // off is nothing to do.
    wait_power(&rt, driver.client(), PowerState::Off);
    rt.block_on(driver.power_off()).unwrap();
    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::Off);
}

#[test]
fn identity_power_and_credentials() {
    let ns = appliance::lab_network("redfish-power").unwrap();
    let libvirt = Libvirt::start(&ns).unwrap();
    let domain =
        libvirt.define("siteboot-redfish-power", "52:54:00:00:03:02", appliance::BRIDGE).unwrap();
    let sushy = Sushy::start(SushyOptions { user: USER, tls: None, netns: None }).unwrap();
    let rt = runtime();
    let address = sushy.address(&domain);
    let driver = Redfish::new(client(&address, USER.1, None));

    let identity = rt.block_on(driver.identity()).unwrap();
    assert_eq!(
        identity,
        Some(Identity { uuid: domain.uuid.clone(), macs: vec![domain.mac.clone()] })
    );

    rt.block_on(driver.client().reset(ResetType::On)).unwrap();
    wait_power(&rt, driver.client(), PowerState::On);
    rt.block_on(driver.power_off()).unwrap();
    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::Off);
    // Off already: nothing to do, no error.
    rt.block_on(driver.power_off()).unwrap();

    let wrong = client(&address, "wrong password", None);
    let error = rt.block_on(wrong.power()).unwrap_err();
    assert!(matches!(error, BmcError::Unauthorized { .. }), "{error}");

    let missing = address.replace(&domain.uuid, "no-such-system");
    let error = rt.block_on(client(&missing, USER.1, None).power()).unwrap_err();
    assert!(matches!(error, BmcError::NotFound { .. }), "{error}");
}

#[test]
fn a_pinned_certificate_is_the_whole_of_the_trust() {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec!["127.0.0.1".into()]).unwrap().self_signed(&key).unwrap();
    let pin = Fingerprint::of(cert.der());
    let ns = appliance::lab_network("redfish-tls").unwrap();
    let libvirt = Libvirt::start(&ns).unwrap();
    let domain =
        libvirt.define("siteboot-redfish-tls", "52:54:00:00:03:03", appliance::BRIDGE).unwrap();
    let tls = Some((cert.pem(), key.serialize_pem()));
    let sushy = Sushy::start(SushyOptions { user: USER, tls, netns: None }).unwrap();
    let rt = runtime();
    let address = sushy.address(&domain);
    assert!(address.starts_with("redfish+https://"), "{address}");

    let other = Fingerprint([0x5a; 32]);
    let error = rt.block_on(client(&address, USER.1, Some(other)).power()).unwrap_err();
    assert!(
        matches!(&error, BmcError::Untrusted { reason, .. } if reason.to_string().contains(&pin.to_string())),
        "{error}"
    );
    // Without a pin, the platform's CAs do not vouch for a self-signed certificate.
    let error = rt.block_on(client(&address, USER.1, None).power()).unwrap_err();
    assert!(matches!(error, BmcError::Untrusted { .. }), "{error}");
    assert!(
        !sushy.log().contains("/redfish/v1/Systems/"),
        "a request got past a refused handshake:\n{}",
        sushy.log()
    );
    assert_eq!(rt.block_on(client(&address, USER.1, Some(pin)).power()).unwrap(), PowerState::Off);
}

#[test]
fn an_unreachable_bmc_is_given_up_after_bounded_retries() {
    let (_refusing, port) = refusing_port().unwrap();
    let address = format!("redfish+http://127.0.0.1:{port}/redfish/v1/Systems/1");
    let retry = RetryPolicy {
        attempts: 3,
        first_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(40),
    };
    let client = client(&address, USER.1, None).with_limits(Duration::from_secs(5), retry);
    let error = runtime().block_on(client.power()).unwrap_err();
    assert!(matches!(error, BmcError::Unreachable { attempts: 3, .. }), "{error}");
}

/// The Host reconciler in Kubernetes mode drives the same emulator: the appliance (in the lab
/// namespace) reaches sushy-tools on that namespace's loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_host_reconciler_checks_boots_reboots_and_powers_off_through_the_bmc() {
    let lab = ProviderLab::start(0, |_| {}).await.unwrap();
    let libvirt = Libvirt::start(&lab.lab).unwrap();
    let mac = "52:54:00:00:03:04";
    let domain = libvirt.define("siteboot-redfish-host", mac, appliance::BRIDGE).unwrap();
    let sushy =
        Sushy::start(SushyOptions { user: USER, tls: None, netns: Some(&lab.lab) }).unwrap();
    let domstate = || libvirt.virsh(&["domstate", &domain.name]).unwrap().trim().to_owned();

    let secrets: Api<Secret> = Api::namespaced(lab.env.client(), NS);
    let secret = |password: &str| Secret {
        metadata: ObjectMeta { name: Some("bmc-host-credentials".into()), ..Default::default() },
        string_data: Some(BTreeMap::from([
            ("username".to_owned(), USER.0.to_owned()),
            ("password".to_owned(), password.to_owned()),
            // The BMC these credentials are for: siteboot sends them nowhere else.
            ("address".to_owned(), sushy.address(&domain)),
        ])),
        ..Default::default()
    };
    secrets.create(&PostParams::default(), &secret("wrong password")).await.unwrap();
    let hosts = lab.hosts();
    let mut host = Host::new("bmc-host", HostSpec::new(mac));
    host.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
    host.spec.bmc = Some(Bmc {
        address: sushy.address(&domain),
        credentials_name: "bmc-host-credentials".into(),
        certificate_fingerprint: None,
        boot_mode: Some(BootMode::Legacy),
    });
    hosts.create(&PostParams::default(), &host).await.unwrap();

    // Wrong credentials: the Host waits in Registering and says why; the machine stays off.
    let bmc_ready = |host: &Host| {
        let c = condition(&host.status.as_ref()?.conditions, BMC_READY)?;
        Some((c.status.clone(), c.reason.clone()))
    };
    let waited = wait_host(&hosts, "BMCReady False BMCUnauthorized", |h| {
        bmc_ready(h) == Some(("False".into(), "BMCUnauthorized".into()))
    })
    .await;
    assert_eq!(waited.status.unwrap().state, Some(HostState::Registering));
    assert_eq!(domstate(), "shut off");

    // The right password: checked again (no watch on Secrets; the recheck delay), registered,
    // and inspection powers the machine on with a network boot.
    secrets.replace("bmc-host-credentials", &PostParams::default(), &secret(USER.1)).await.unwrap();
    let waited = wait_host(&hosts, "Inspecting", |h| {
        h.status.as_ref().and_then(|s| s.state) == Some(HostState::Inspecting)
    })
    .await;
    assert_eq!(bmc_ready(&waited), Some(("True".into(), "BMCReachable".into())));
    siteboot_tests::wait::for_("the domain to run", POWER_TIMEOUT, || {
        (domstate() == "running").then_some(())
    })
    .unwrap();
    // sushy-tools puts the override in libvirt's per-device boot order: the NIC first; and
    // the Host's boot mode in the firmware loader it defines (Legacy: SeaBIOS's `rom`).
    let xml = libvirt.virsh(&["dumpxml", &domain.name]).unwrap();
    let nic = xml.split("<interface").nth(1).and_then(|rest| rest.split("</interface>").next());
    assert!(nic.is_some_and(|nic| nic.contains("<boot order='1'/>")), "{xml}");
    let loader = xml.split("<loader").nth(1).and_then(|rest| rest.split("</loader>").next());
    assert!(loader.is_some_and(|l| l.contains("type='rom'")), "{xml}");

    // The reboot annotation powers a machine that is off back on (an operation runs: from
    // the network), then goes.
    libvirt.virsh(&["destroy", &domain.name]).unwrap();
    let annotate = |key: &str| json!({ "metadata": { "annotations": { key: "" } } });
    hosts
        .patch("bmc-host", &PatchParams::default(), &Patch::Merge(annotate(REBOOT_ANNOTATION)))
        .await
        .unwrap();
    wait_host(&hosts, "the reboot annotation to go", |h| {
        !h.annotations().contains_key(REBOOT_ANNOTATION)
    })
    .await;
    assert_eq!(domstate(), "running");

    // A deleted Host (let go at once: no wipe) is powered off before it goes.
    hosts
        .patch(
            "bmc-host",
            &PatchParams::default(),
            &Patch::Merge(annotate(FORCE_DELETE_ANNOTATION)),
        )
        .await
        .unwrap();
    hosts.delete("bmc-host", &DeleteParams::default()).await.unwrap();
    siteboot_tests::wait::for_async("the Host to go", POWER_TIMEOUT, || async {
        hosts.get_opt("bmc-host").await.unwrap().is_none().then_some(())
    })
    .await
    .unwrap();
    assert_eq!(domstate(), "shut off");
}

/// Waits until the Host `bmc-host` satisfies `done`; returns it.
async fn wait_host(hosts: &Api<Host>, what: &str, done: impl Fn(&Host) -> bool) -> Host {
    siteboot_tests::wait::for_async(what, Duration::from_secs(120), || async {
        hosts.get("bmc-host").await.ok().filter(|h| done(h))
    })
    .await
    .unwrap()
}

/// Issue 22 item 4 at the BMC: whoever answers for the appliance's address on the BMC's
/// network could serve the virtual media. Without a certificate to trust (as before), the
/// emulator takes an impostor's ISO; with the appliance's certificate installed, it refuses the
/// impostor and takes the appliance's.
#[test]
fn virtual_media_is_taken_only_from_the_server_whose_certificate_siteboot_installed() {
    let ns = appliance::lab_network("redfish-media").unwrap();
    let libvirt = Libvirt::start(&ns).unwrap();
    let domain =
        libvirt.define("siteboot-redfish-media", "52:54:00:00:03:05", appliance::BRIDGE).unwrap();
    let sushy = Sushy::start(SushyOptions { user: USER, tls: None, netns: None }).unwrap();
    let rt = runtime();
    let driver = Redfish::new(client(&sushy.address(&domain), USER.1, None));
    let appliance = IsoServer::start(b"the appliance's ISO");
    let impostor = IsoServer::start(b"an impostor's ISO");
    let inserted = || {
        let (_, cd) = rt.block_on(driver.client().virtual_cd()).unwrap();
        cd.inserted
    };

    // Before: no certificate to trust, and the emulator, like most BMCs, checks none.
    let checks = rt.block_on(driver.client().insert_cd(&impostor.url, None)).unwrap();
    assert!(!checks && inserted(), "the impostor's ISO was not taken without a certificate");
    rt.block_on(driver.client().eject_cd()).unwrap();
    assert!(!inserted());

    // The appliance's certificate installed: the impostor is refused, nothing is inserted.
    let error = rt
        .block_on(driver.client().insert_cd(&impostor.url, Some(&appliance.certificate)))
        .unwrap_err();
    assert!(!inserted(), "the impostor's ISO was inserted: {error}");
    let checks =
        rt.block_on(driver.client().insert_cd(&appliance.url, Some(&appliance.certificate)));
    assert!(checks.unwrap() && inserted(), "the appliance's ISO was not taken");
    assert_eq!(
        appliance.served(),
        1,
        "the appliance's ISO was fetched {} times",
        appliance.served()
    );
}

/// An HTTPS server on 127.0.0.1 with a certificate of its own, serving `body` at any path.
struct IsoServer {
    url: String,
    /// Its certificate, PEM.
    certificate: String,
    served: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl IsoServer {
    fn start(body: &'static [u8]) -> Self {
        let SelfSigned { certificate, config } = SelfSigned::new("127.0.0.1").unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("https://{}/media/test.iso", listener.local_addr().unwrap());
        let (served, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (count, stopped) = (served.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok((stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                stream.set_nonblocking(false).unwrap();
                stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let connection = rustls::ServerConnection::new(config.clone()).unwrap();
                let mut tls = rustls::StreamOwned::new(connection, stream);
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // A refused handshake ends here, in an error: nothing is served.
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match std::io::Read::read(&mut tls, &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                if !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    continue;
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let sent = std::io::Write::write_all(&mut tls, head.as_bytes())
                    .and_then(|()| std::io::Write::write_all(&mut tls, body))
                    .and_then(|()| std::io::Write::flush(&mut tls));
                if sent.is_ok() {
                    count.fetch_add(1, Ordering::Relaxed);
                }
                tls.conn.send_close_notify();
                let _ = std::io::Write::flush(&mut tls);
            }
        });
        Self { url, certificate, served, stop }
    }

    fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }
}

impl Drop for IsoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
