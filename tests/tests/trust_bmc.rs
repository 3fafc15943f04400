//! A Host editor (who may edit Hosts but not read Secrets) points a Host's `spec.bmc` at a
//! server of theirs and at another host's BMC credentials Secret, through the real Host
//! reconciler: siteboot must send those credentials nowhere and echo nothing the server
//! answers. The server is a listener on the loopback of the lab namespace, where siteboot runs.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_controller::conditions::BMC_READY;
use siteboot_controller::crd::{Bmc, Host, HostSpec, SITE_LABEL, condition};
use siteboot_tests::provider::{NS, ProviderLab, SITE};
use siteboot_tests::wait;

const SYSTEM: &str = "/redfish/v1/Systems/1";
/// What the editor's server answers, and must not show in the Host's status or Events.
const MARKER: &str = "ANSWER-FROM-THE-EDITORS-SERVER";
const STEP: Duration = Duration::from_secs(120);

/// The request heads the editor's server received.
type Seen = Arc<Mutex<Vec<String>>>;

/// A server on the lab namespace's loopback that answers like a BMC without sessions, except
/// that its system answers 400 with 10 KiB of control characters and markup. Returns its port.
fn editors_server(lab: &ProviderLab, seen: Seen) -> u16 {
    let listener = lab
        .lab
        .enter(|| Ok(TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))?))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut tcp in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut buf = [0; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match tcp.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let head = String::from_utf8_lossy(&head).into_owned();
            let system = head.starts_with(&format!("GET {SYSTEM} "));
            seen.lock().unwrap().push(head);
            let (status, body) = match system {
                true => ("400 Bad Request", format!("\u{1b}[2J<b>{MARKER}</b>\r\n\0").repeat(256)),
                false => ("200 OK", "{}".to_owned()),
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tcp.write_all(response.as_bytes());
        }
    });
    port
}

fn secret(name: &str, address: &str) -> Secret {
    Secret {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        string_data: Some(BTreeMap::from([
            ("username".to_owned(), "root".to_owned()),
            ("password".to_owned(), "other-hosts-password".to_owned()),
            ("address".to_owned(), address.to_owned()),
        ])),
        ..Default::default()
    }
}

/// The Host's BMCReady condition once it differs from `before`: `(status, reason, message)`.
async fn bmc_ready_after(
    hosts: &Api<Host>,
    before: Option<(String, String, String)>,
) -> (String, String, String) {
    wait::for_async("the Host's BMCReady condition", STEP, || async {
        let status = hosts.get("planted").await.ok()?.status?;
        let c = condition(&status.conditions, BMC_READY)?;
        let now = (c.status.clone(), c.reason.clone(), c.message.clone());
        (Some(&now) != before.as_ref()).then_some(now)
    })
    .await
    .unwrap()
}

/// Asserts that nothing the editor's server answered reached the Host's status or Events.
async fn assert_nothing_echoed(lab: &ProviderLab) {
    let host = lab.hosts().get("planted").await.unwrap();
    let status = serde_json::to_string(&host.status).unwrap();
    assert!(!status.contains(MARKER), "the server's answer is in the status: {status}");
    let events: Api<Event> = Api::namespaced(lab.env.client(), NS);
    for event in events.list(&ListParams::default()).await.unwrap() {
        let note = event.note.unwrap_or_default();
        assert!(!note.contains(MARKER), "the server's answer is in an Event: {note:?}");
        assert!(!note.chars().any(char::is_control), "an Event has control characters: {note:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_host_editor_gets_no_bmc_credentials_sent_to_a_server_of_theirs() {
    let lab = ProviderLab::start(0, |_| {}).await.unwrap();
    let seen: Seen = Arc::default();
    let port = editors_server(&lab, seen.clone());
    let attacker = format!("redfish+http://127.0.0.1:{port}{SYSTEM}");
    let secrets: Api<Secret> = Api::namespaced(lab.env.client(), NS);
    let pp = PostParams::default();
    // Another host's BMC credentials, for its BMC.
    let other = secret("other-bmc", "redfish+https://10.99.0.42/redfish/v1/Systems/1");
    secrets.create(&pp, &other).await.unwrap();

    // The editor's Host: the other host's Secret, the editor's address.
    let hosts = lab.hosts();
    let mut host = Host::new("planted", HostSpec::new("52:54:00:00:0e:07"));
    host.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
    host.spec.bmc = Some(Bmc {
        address: attacker.clone(),
        credentials_name: "other-bmc".into(),
        certificate_fingerprint: None,
        boot_mode: None,
    });
    hosts.create(&pp, &host).await.unwrap();
    let refused = bmc_ready_after(&hosts, None).await;
    let reached = seen.lock().unwrap().clone();
    assert!(
        reached.is_empty(),
        "the editor's server got {} request(s): {reached:#?}",
        reached.len()
    );
    assert_eq!(refused.1, "BMCCredentialsNotForThisAddress", "{refused:?}");
    assert!(!refused.2.contains("10.99.0.42"), "the Secret's address is shown: {refused:?}");
    assert_nothing_echoed(&lab).await;

    // Positive control: credentials whose Secret names that server do reach it, and what it
    // answers is not echoed.
    secrets.create(&pp, &secret("its-own-bmc", &attacker)).await.unwrap();
    let point = |name: &str| json!({ "spec": { "bmc": { "credentialsName": name } } });
    hosts
        .patch("planted", &PatchParams::default(), &Patch::Merge(point("its-own-bmc")))
        .await
        .unwrap();
    let failed = bmc_ready_after(&hosts, Some(refused)).await;
    assert_eq!(failed.1, "BMCFailed", "{failed:?}");
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|h| h.to_ascii_lowercase().contains("authorization: basic ")),
        "the listener is reachable from siteboot"
    );
    assert!(
        failed.2.chars().count() <= 200 && !failed.2.chars().any(char::is_control),
        "{failed:?}"
    );
    assert_nothing_echoed(&lab).await;

    // The editor points the Host back at the other host's Secret: checked again before
    // anything is sent, through the next rechecks too.
    hosts
        .patch("planted", &PatchParams::default(), &Patch::Merge(point("other-bmc")))
        .await
        .unwrap();
    let refused = bmc_ready_after(&hosts, Some(failed)).await;
    assert_eq!(refused.1, "BMCCredentialsNotForThisAddress", "{refused:?}");
    let before = seen.lock().unwrap().len();
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert_eq!(seen.lock().unwrap().len(), before, "requests after the Host was pointed away");
}
