//! A Host reached over SSH registers through the real Host reconciler: the appliance (in
//! Kubernetes mode, with the RBAC it ships) logs in to a real sshd on the lab namespace's
//! loopback with the key of the Host's `siteboot.dev/ssh-access` Secret.
//!
//! - a Host editor's Host names the server and another server's Secret: `SSHReady` False
//!   `SSHCredentialsNotForThisServer` (without the Secret's address), and sshd sees no
//!   connection;
//! - the Secret pins another host key: `SSHReady` False `HostKeyMismatch` naming both
//!   fingerprints, the Host stays Registering, and sshd's log (DEBUG3) has no authentication
//!   request: it never learnt the user or the client's key;
//! - the Secret fixed to the server's key: `SSHReady` True `LoggedIn`, and the Host, whose boot
//!   MAC is the lab namespace's bridge's, is inspected over SSH: Available, with hardware whose
//!   NICs include that MAC and whose system UUID is this machine's;
//! - a second Host whose Secret asks for trust on first use: True, and `status.sshHostKey` is
//!   the server's `.pub`; its boot MAC is on no interface of the server, so it is quarantined
//!   `SSHServerIsNotThisHost` with no hardware, and never Available.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_controller::conditions::{READY, SSH_READY};
use siteboot_controller::crd::{
    Access, Host, HostSpec, HostState, SITE_LABEL, SshAccess, SshMode, condition,
};
use siteboot_controller::ssh::SECRET_TYPE;
use siteboot_tests::netns::Netns;
use siteboot_tests::provider::{NS, ProviderLab, SITE};
use siteboot_tests::sshd::{PORT, Sshd};
use siteboot_tests::wait;

const STEP: Duration = Duration::from_secs(120);

fn secret(name: &str, sshd: &Sshd, trust: (&str, String)) -> Secret {
    Secret {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        type_: Some(SECRET_TYPE.into()),
        string_data: Some(BTreeMap::from([
            ("privateKey".to_owned(), sshd.read("client").unwrap()),
            (trust.0.to_owned(), trust.1),
            ("address".to_owned(), "127.0.0.1".to_owned()),
            ("port".to_owned(), PORT.to_string()),
        ])),
        ..Default::default()
    }
}

fn host(name: &str, mac: &str, credentials: &str) -> Host {
    let mut host = Host::new(name, HostSpec::new(mac));
    host.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
    host.spec.access = Some(Access {
        ssh: Some(SshAccess {
            address: "127.0.0.1".into(),
            port: PORT,
            user: "root".into(),
            mode: SshMode::Adopt,
            credentials_name: credentials.into(),
        }),
    });
    host
}

/// The MAC of `link` in `ns`, as `ip link` shows it: a MAC the server there really has.
fn mac_of(ns: &Netns, link: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["-n", ns.name(), "link", "show", link])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut words = text.split_whitespace().skip_while(|w| *w != "link/ether");
    words.nth(1).unwrap_or_else(|| panic!("no link/ether in {text:?}")).to_owned()
}

/// Past registration and inspection: where an SSH Host's inspection leaves it.
fn settled(state: HostState) -> bool {
    !matches!(state, HostState::Registering | HostState::Inspecting)
}

/// The Host once `done` accepts its state.
async fn host_when(hosts: &Api<Host>, name: &str, done: impl Fn(HostState) -> bool) -> Host {
    wait::for_async("the Host's state", STEP, || async {
        let host = hosts.get(name).await.ok()?;
        let state = host.status.as_ref()?.state?;
        done(state).then_some(host)
    })
    .await
    .unwrap()
}

/// The Host's SSHReady condition once it differs from `before`: `(status, reason, message)`.
async fn ssh_ready_after(
    hosts: &Api<Host>,
    name: &str,
    before: Option<&(String, String, String)>,
) -> (String, String, String) {
    wait::for_async("the Host's SSHReady condition", STEP, || async {
        let status = hosts.get(name).await.ok()?.status?;
        let c = condition(&status.conditions, SSH_READY)?;
        let now = (c.status.clone(), c.reason.clone(), c.message.clone());
        (Some(&now) != before).then_some(now)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_host_reached_over_ssh_registers_only_with_its_pinned_host_key() {
    let lab = ProviderLab::start(0, |_| {}).await.unwrap();
    let keys = [("host_ed25519", "ed25519"), ("client", "ed25519"), ("not_the_host", "ed25519")];
    let sshd = Sshd::start(&lab.lab, &keys).unwrap();
    let secrets: Api<Secret> = Api::namespaced(lab.env.client(), NS);
    let hosts = lab.hosts();
    let pp = PostParams::default();

    // A Host editor's attack: their Host names this server, and another server's Secret (the
    // right host key even). The key goes nowhere: sshd sees no connection at all.
    let mut other = secret("other", &sshd, ("hostKey", sshd.read("host_ed25519.pub").unwrap()));
    let other_data = other.string_data.as_mut().unwrap();
    other_data.insert("address".into(), "10.99.0.42".into());
    secrets.create(&pp, &other).await.unwrap();
    hosts.create(&pp, &host("planted", "52:54:00:00:5e:03", "other")).await.unwrap();
    let planted = ssh_ready_after(&hosts, "planted", None).await;
    assert_eq!(
        (planted.0.as_str(), planted.1.as_str()),
        ("False", "SSHCredentialsNotForThisServer"),
        "{planted:?}"
    );
    assert!(!planted.2.contains("10.99.0.42"), "the Secret's address is shown: {planted:?}");
    let log = sshd.log();
    assert!(!log.contains("Connection from"), "siteboot connected for the planted Host:\n{log}");

    // Pinned to a key the server does not have.
    let wrong = ("hostKey", sshd.read("not_the_host.pub").unwrap());
    secrets.create(&pp, &secret("pinned", &sshd, wrong)).await.unwrap();
    let boot_mac = mac_of(&lab.lab, "br0");
    hosts.create(&pp, &host("adopted", &boot_mac, "pinned")).await.unwrap();
    let refused = ssh_ready_after(&hosts, "adopted", None).await;
    assert_eq!(
        (refused.0.as_str(), refused.1.as_str()),
        ("False", "HostKeyMismatch"),
        "{refused:?}"
    );
    for name in ["not_the_host", "host_ed25519"] {
        assert!(refused.2.contains(&sshd.fingerprint(name).unwrap()), "{name}: {refused:?}");
    }
    // Past a few rechecks, sshd has seen connections and not one authentication request.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let log = sshd.log();
    assert!(log.contains("Connection from 127.0.0.1"), "siteboot never connected:\n{log}");
    for needle in sshd.login_needles("root").unwrap() {
        assert!(
            !log.contains(&needle),
            "sshd's log has {needle:?}: more than the key exchange was sent"
        );
    }
    let state = hosts.get("adopted").await.unwrap().status.unwrap().state;
    assert_eq!(state, Some(HostState::Registering));

    // The Secret fixed: the recheck logs in.
    let fixed = json!({ "stringData": { "hostKey": sshd.read("host_ed25519.pub").unwrap() } });
    secrets.patch("pinned", &PatchParams::default(), &Patch::Merge(&fixed)).await.unwrap();
    let ok = ssh_ready_after(&hosts, "adopted", Some(&refused)).await;
    assert_eq!((ok.0.as_str(), ok.1.as_str()), ("True", "LoggedIn"), "{ok:?}");
    assert!(ok.2.contains(&sshd.fingerprint("host_ed25519").unwrap()), "{ok:?}");
    assert!(sshd.log().contains("Accepted publickey for root"));
    assert_eq!(hosts.get("adopted").await.unwrap().status.unwrap().ssh_host_key, None);

    // Inspected over SSH: the server has the boot MAC, so it is this Host's machine.
    let adopted = host_when(&hosts, "adopted", settled).await;
    let status = adopted.status.unwrap();
    assert_eq!(status.state, Some(HostState::Available), "{:?}", status.conditions);
    let hardware = status.hardware.unwrap();
    assert!(hardware.nics.iter().any(|n| n.mac == boot_mac), "{boot_mac}: {hardware:?}");
    assert!(hardware.cpus > 0 && hardware.memory_mib > 0, "{hardware:?}");
    let uuid = std::fs::read_to_string("/sys/class/dmi/id/product_uuid").ok();
    assert_eq!(
        hardware.system.map(|s| s.uuid),
        uuid.map(|u| u.trim().to_ascii_lowercase()),
        "the system UUID is not this machine's"
    );

    // Trust on first use: the key presented is recorded.
    let tofu = ("trustOnFirstUse", "true".to_owned());
    secrets.create(&pp, &secret("tofu", &sshd, tofu)).await.unwrap();
    hosts.create(&pp, &host("tofu", "52:54:00:00:5e:02", "tofu")).await.unwrap();
    let ok = ssh_ready_after(&hosts, "tofu", None).await;
    assert_eq!((ok.0.as_str(), ok.1.as_str()), ("True", "LoggedIn"), "{ok:?}");
    let record = hosts.get("tofu").await.unwrap().status.unwrap().ssh_host_key.unwrap();
    let public = sshd.read("host_ed25519.pub").unwrap();
    let mut words = public.split_whitespace();
    let line = format!("{} {}", words.next().unwrap(), words.next().unwrap());
    assert_eq!(record.key, line);
    assert_eq!(record.fingerprint, sshd.fingerprint("host_ed25519").unwrap());
    assert_eq!((record.address.as_str(), record.port), ("127.0.0.1", PORT));

    // Its boot MAC is none of the server's: not this Host's machine, whatever it logged in to.
    let tofu = host_when(&hosts, "tofu", settled).await;
    let status = tofu.status.unwrap();
    assert_eq!(status.state, Some(HostState::Quarantined), "{:?}", status.conditions);
    let ready = condition(&status.conditions, READY).unwrap();
    assert_eq!(ready.reason, "SSHServerIsNotThisHost", "{ready:?}");
    assert!(ready.message.contains(&boot_mac), "the MACs seen are not named: {ready:?}");
    assert_eq!(status.hardware, None);
}
