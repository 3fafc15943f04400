//! siteboot's Redfish driver against a real Redfish service: sushy-tools' emulator driving
//! libvirt/QEMU (TCG) VMs on a test namespace's bridge (see `siteboot_tests::redfish`). A
//! powered-off VM whose disk is empty is powered on with a one-time network boot, PXE-boots the
//! test ramdisk from the standalone appliance and calls back; identity, power, credentials,
//! certificate pinning and retries are checked against the same emulator.
//!
//! Failures panic while the lab is alive, so the VM console and daemon logs get printed.

use std::time::Duration;

use serde_json::json;
use siteboot_agent::Fingerprint;
use siteboot_controller::bmc::redfish::protocol::{BootOverride, ResetType};
use siteboot_controller::bmc::redfish::retry::RetryPolicy;
use siteboot_controller::bmc::{
    BmcDriver, BmcError, Credentials, Identity, Redfish, RedfishAddress, RedfishClient,
};
use siteboot_controller::crd::PowerState;
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::initramfs;
use siteboot_tests::redfish::{Libvirt, Sushy, SushyOptions, free_port};

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
    RedfishClient::new(address, Credentials::new(USER.0, password).unwrap(), pin).unwrap()
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
    let mut config = appliance::lab_config("full");
    config["profiles"][appliance::LAB_PROFILE]["cmdline"] = json!("console=ttyS0 quiet panic=-1");
    let siteboot = Appliance::start(&ns, config).unwrap();
    siteboot.install_boot_files(&boot).unwrap();
    let libvirt = Libvirt::start(&ns).unwrap();
    let domain = libvirt.define("siteboot-redfish-boot", mac, appliance::BRIDGE).unwrap();
    let sushy = Sushy::start(SushyOptions { user: USER, tls: None }).unwrap();
    let rt = runtime();
    let driver = Redfish::new(client(&sushy.address(&domain), USER.1, None));

    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::Off);
    rt.block_on(driver.boot_from_network()).unwrap();
    // sushy-tools takes the override but not its Once: it sets libvirt's boot device for good
    // and reports Continuous. A real BMC clears the override after one boot.
    assert_eq!(
        rt.block_on(driver.client().boot_override()).unwrap(),
        BootOverride { target: Some("Pxe".into()), enabled: Some("Continuous".into()) }
    );
    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::On);

    // The disk is empty: only the network boot reaches the ramdisk's callback.
    let marker = domain.wait_for_console("SITEBOOT-TEST: callback", BOOT_TIMEOUT).unwrap();
    assert_eq!(marker, "SITEBOOT-TEST: callback ok");
    let stages = appliance::stages(&siteboot.timeline(mac).unwrap());
    for stage in ["dhcp-ack", "ipxe-script", "report"] {
        assert!(stages.iter().any(|s| s == stage), "no {stage} in the timeline: {stages:?}");
    }
    // The ramdisk halts after its callback (no ACPI power-off in it): the VM stays on.
    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::On);
    rt.block_on(driver.power_off()).unwrap();
    assert_eq!(rt.block_on(driver.power()).unwrap(), PowerState::Off);
}

#[test]
fn identity_power_and_credentials() {
    let ns = appliance::lab_network("redfish-power").unwrap();
    let libvirt = Libvirt::start(&ns).unwrap();
    let domain =
        libvirt.define("siteboot-redfish-power", "52:54:00:00:03:02", appliance::BRIDGE).unwrap();
    let sushy = Sushy::start(SushyOptions { user: USER, tls: None }).unwrap();
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
    let sushy = Sushy::start(SushyOptions { user: USER, tls }).unwrap();
    let rt = runtime();
    let address = sushy.address(&domain);
    assert!(address.starts_with("redfish+https://"), "{address}");

    let other = Fingerprint([0x5a; 32]);
    let error = rt.block_on(client(&address, USER.1, Some(other)).power()).unwrap_err();
    assert!(
        matches!(&error, BmcError::Untrusted { reason, .. } if reason.contains(&pin.to_string())),
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
    let port = free_port().unwrap();
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
