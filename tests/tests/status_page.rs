//! The status page in a real browser (Debian's headless Chromium, driven by selenium; see
//! `siteboot_tests::browser`), against the real appliance in a lab namespace:
//!
//! - it loads with no console errors, lists the configured hosts with their reservation's name
//!   and address, and shows this appliance's health;
//! - while a QEMU VM (SeaBIOS + iPXE, TCG) network-boots, the VM's row and its timeline
//!   change in the open page, without a reload: DHCP, then the script, kernel, ramdisk and the
//!   boot's report, each with a duration;
//! - a step detail a client chose (a file name with markup) is shown as text: no element is
//!   made from it and no script runs;
//! - with 1,000 hosts every one is listed and the filter box finds one;
//! - in Kubernetes mode it lists the Host cache, and a Host's change (a ramdisk's progress
//!   report, a cordon) shows in the open page.
//!
//! The browser takes a screenshot of the booted VM's page: to `SITEBOOT_STATUS_SCREENSHOT` if
//! set (that is how `docs/status-page.png` is made), else into a temporary directory.

use std::time::Duration;

use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::browser::Browser;
use siteboot_tests::clients::{ClientHost, Udhcpc};
use siteboot_tests::initramfs;
use siteboot_tests::netns;
use siteboot_tests::provider::{self, ProviderLab, Sims};
use siteboot_tests::vm::{Firmware, Vm, VmConfig};
use siteboot_tests::wait;

/// From QEMU start to the callback: ~30 s under TCG; generous for CI (as in boot_vm.rs).
const BOOT_TIMEOUT: Duration = Duration::from_secs(240);
/// For the page to show what the appliance already did.
const PAGE_TIMEOUT: Duration = Duration::from_secs(60);
const VM_MAC: &str = "52:54:00:00:00:21";
const VM_NAME: &str = "rack1-node07";
/// A client that asks for a file whose name is markup.
const HOSTILE_MAC: &str = "52:54:00:66:66:66";
const HOSTILE_FILE: &str = "<img src=x onerror=window.pwned=1>.txt";

/// The page's row for `mac`, as a JavaScript expression.
fn row(mac: &str) -> String {
    format!("document.querySelector('tr.host[data-mac=\"{mac}\"]')")
}

/// JavaScript: the phases of `mac`'s chart, comma-separated, once they include `phase`.
fn phases_once(mac: &str, phase: &str) -> String {
    format!(
        "const r = {}; if (!r) return null;
         const p = [...r.querySelectorAll('.chart .seg')].map(s => s.dataset.phase);
         return p.includes('{phase}') ? p.join(',') : null;",
        row(mac)
    )
}

fn console_errors(browser: &mut Browser) -> Vec<String> {
    let entries = browser.console().unwrap();
    entries.into_iter().filter(|e| e.level == "SEVERE").map(|e| e.message).collect()
}

#[test]
fn the_page_follows_a_vm_boot_live_and_shows_hostile_strings_as_text() {
    let boot = initramfs::boot_files().unwrap();
    let ns = appliance::lab_network("status").unwrap();
    let mut config = appliance::lab_config("full");
    // The VM and a few hosts that stay off, each with a reservation: a name and an address.
    let mut hosts = vec![json!({ "mac": VM_MAC, "profile": appliance::LAB_PROFILE })];
    let mut reservations =
        vec![json!({ "mac": VM_MAC, "address": "10.99.0.21", "hostname": VM_NAME })];
    for n in 1..=5 {
        let mac = format!("52:54:00:00:01:{n:02x}");
        hosts.push(json!({ "mac": mac, "profile": appliance::LAB_PROFILE }));
        reservations.push(json!({
            "mac": mac, "address": format!("10.99.0.{}", 30 + n), "hostname": format!("rack1-node{n:02}"),
        }));
    }
    config["hosts"] = json!(hosts);
    config["dhcp"]["reservations"] = json!(reservations);
    let siteboot = Appliance::start(&ns, config).unwrap();
    siteboot.install_boot_files(&boot).unwrap();
    std::fs::write(siteboot.http_root().join(HOSTILE_FILE), "x").unwrap();

    // The hostile client holds a lease, so its requests are attributed to its MAC.
    let client = ClientHost::attach(&ns, appliance::BRIDGE, HOSTILE_MAC).unwrap();
    let mut udhcpc = Udhcpc::start(&client, &[]).unwrap();
    udhcpc.wait_bound(Duration::from_secs(30)).unwrap();
    let fetch_hostile_file = || {
        let url = format!("{}/files/{}", siteboot.base_url(), percent_encode(HOSTILE_FILE));
        let out = netns::output(
            client
                .ns
                .command("curl")
                .args(["-sS", "--max-time", "10", "-w", "%{http_code}", "-o", "/dev/null"])
                .arg(&url),
        )
        .unwrap();
        assert_eq!(out, "200", "GET {url}");
    };
    // Once before the page opens (it arrives in the snapshot), once after (as a live step).
    fetch_hostile_file();

    let mut browser = Browser::start(&ns).unwrap();
    browser.open(&format!("{}/", siteboot.base_url())).unwrap();
    browser
        .wait(
            "the snapshot with the VM's row",
            &format!("return {} !== null;", row(VM_MAC)),
            PAGE_TIMEOUT,
        )
        .unwrap();
    // A mark on this document: if it is still there at the end, the page never reloaded.
    browser.eval("window.sitebootTestMark = 'same page'; return null;").unwrap();

    let listed = browser
        .eval(
            "return [...document.querySelectorAll('tr.host')].map(r => ({
                 mac: r.dataset.mac,
                 cells: [...r.cells].map(c => c.textContent),
             }));",
        )
        .unwrap();
    let listed = listed.as_array().unwrap();
    let cells_of = |mac: &str| -> Vec<String> {
        let row = listed
            .iter()
            .find(|r| r["mac"] == mac)
            .unwrap_or_else(|| panic!("no row for {mac}: {listed:?}"));
        row["cells"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(listed.len(), 7, "6 configured hosts and the hostile client: {listed:?}");
    let vm = cells_of(VM_MAC);
    assert_eq!(&vm[..4], [VM_NAME, VM_MAC, "10.99.0.21", "profile lab"], "{vm:?}");
    assert_eq!(cells_of("52:54:00:00:01:03")[0], "rack1-node03");

    // The hostile file name: shown as the text it is, in the snapshot and as a live step.
    let hostile_shown = |browser: &mut Browser| {
        let shown = browser
            .eval(&format!(
                "const r = {};
                 return {{ text: r.textContent, images: document.querySelectorAll('img').length,
                          pwned: window.pwned === undefined ? null : window.pwned }};",
                row(HOSTILE_MAC)
            ))
            .unwrap();
        assert!(shown["text"].as_str().unwrap().contains(HOSTILE_FILE), "{shown}");
        assert_eq!(shown["images"], 0, "an element was made from the file name: {shown}");
        assert_eq!(shown["pwned"], Value::Null, "the file name ran a script: {shown}");
    };
    hostile_shown(&mut browser);
    let steps_before = browser.eval("return Number(document.body.dataset.steps || 0);").unwrap();
    fetch_hostile_file();
    browser
        .wait(
            "the hostile client's step to arrive live",
            &format!("return Number(document.body.dataset.steps || 0) > {steps_before};"),
            PAGE_TIMEOUT,
        )
        .unwrap();
    hostile_shown(&mut browser);

    // The VM boots while the page is open.
    let tap = ns.add_tap(appliance::BRIDGE).unwrap();
    let mut vm = Vm::start(&ns, VmConfig::new("status", Firmware::Bios, VM_MAC, &tap)).unwrap();
    let early =
        browser.wait("the VM's DHCP in its timeline", &phases_once(VM_MAC, "dhcp"), BOOT_TIMEOUT);
    let early = early.unwrap_or_else(|e| panic!("{e:#}\n{}", vm.console_tail()));
    let marker = vm.wait_for_console("SITEBOOT-TEST: callback", BOOT_TIMEOUT).unwrap();
    assert_eq!(marker, "SITEBOOT-TEST: callback ok");
    let done = browser
        .wait("the VM's report in its timeline", &phases_once(VM_MAC, "report"), PAGE_TIMEOUT)
        .unwrap();
    let done = done.as_str().unwrap().to_owned();
    assert!(
        done.starts_with(early.as_str().unwrap()),
        "the timeline was redrawn, not extended: {early} -> {done}"
    );
    let order = ["dhcp", "script", "kernel", "ramdisk", "report"];
    let mut phases = done.split(',');
    for phase in order {
        assert!(phases.any(|p| p == phase), "{order:?} not in this order in {done}");
    }
    let page = browser
        .eval(&format!(
            "const r = {};
             return {{ mark: window.sitebootTestMark || null, snapshots: document.body.dataset.snapshots,
                      last: r.cells[7].textContent, ready: document.getElementById('ready').textContent,
                      role: document.getElementById('role').textContent,
                      steps: document.querySelector('[data-counter=\"boot_steps\"] .value').textContent }};",
            row(VM_MAC)
        ))
        .unwrap();
    assert_eq!(page["mark"], "same page", "the page reloaded: {page}");
    assert_eq!(page["snapshots"], "1", "the updates came as a new snapshot, not live: {page}");
    assert!(page["last"].as_str().unwrap().contains("running"), "last step: {page}");
    assert_eq!(
        (page["role"].as_str(), page["ready"].as_str()),
        (Some("only replica"), Some("ready"))
    );
    assert_ne!(page["steps"], "0", "{page}");

    // The VM's timeline with a duration per phase.
    browser.click(&format!("tr.host[data-mac=\"{VM_MAC}\"]")).unwrap();
    let gantt = browser
        .wait(
            "the VM's timeline with durations",
            "const g = document.querySelector('tr.details .gantt'); if (!g) return null;
             return [...g.querySelectorAll('.duration')].map(d => d.textContent);",
            PAGE_TIMEOUT,
        )
        .unwrap();
    let durations = gantt.as_array().unwrap();
    assert!(durations.len() >= order.len(), "{gantt}");
    assert!(
        durations
            .iter()
            .all(|d| d.as_str().unwrap().ends_with(" ms") || d.as_str().unwrap().ends_with(" s")),
        "{gantt}"
    );

    let screenshots = tempfile::tempdir().unwrap();
    let path = std::env::var_os("SITEBOOT_STATUS_SCREENSHOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| screenshots.path().join("status-page.png"));
    browser.screenshot(&path).unwrap();
    assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"), "{}", path.display());
    assert_eq!(console_errors(&mut browser), Vec::<String>::new());
    vm.wait_exit(Duration::from_secs(30)).expect("the VM powers off after the callback");
}

#[test]
fn a_thousand_hosts_are_listed_and_the_filter_finds_one() {
    let ns = appliance::lab_network("status1k").unwrap();
    let mut config = appliance::lab_config("full");
    let mac = |n: u32| format!("52:54:01:00:{:02x}:{:02x}", n >> 8, n & 0xff);
    config["hosts"] = json!(
        (0..1000)
            .map(|n| json!({ "mac": mac(n), "profile": appliance::LAB_PROFILE }))
            .collect::<Vec<_>>()
    );
    // Some have a name (a reservation in the /24).
    config["dhcp"]["reservations"] = json!((0..50)
        .map(|n| json!({ "mac": mac(n), "address": format!("10.99.0.{}", 2 + n), "hostname": format!("node-{n:04}") }))
        .collect::<Vec<_>>());
    let siteboot = Appliance::start(&ns, config).unwrap();
    let mut browser = Browser::start(&ns).unwrap();
    browser.open(&format!("{}/", siteboot.base_url())).unwrap();
    let visible = "return [...document.querySelectorAll('tr.host')].filter(r => !r.hidden).map(r => r.dataset.mac);";
    browser
        .wait(
            "1,000 hosts listed",
            "return document.querySelectorAll('tr.host').length === 1000 &&
                    document.getElementById('count').textContent === '1000 hosts';",
            PAGE_TIMEOUT,
        )
        .unwrap();

    for (typed, expected) in [(mac(999), mac(999)), ("NODE-0042".to_owned(), mac(42))] {
        browser.type_into("#filter", &typed).unwrap();
        let what = format!("the filter {typed:?} to leave one row");
        let shown = browser
            .wait(
                &what,
                &format!("const v = (() => {{ {visible} }})(); return v.length === 1 ? v : null;"),
                PAGE_TIMEOUT,
            )
            .unwrap();
        assert_eq!(shown, json!([expected]), "filter {typed:?}");
        let count = browser.eval("return document.getElementById('count').textContent;").unwrap();
        assert_eq!(count, "1 of 1000 hosts");
    }
    browser.type_into("#filter", "").unwrap();
    browser
        .wait(
            "every row back",
            &format!("const v = (() => {{ {visible} }})(); return v.length === 1000;"),
            PAGE_TIMEOUT,
        )
        .unwrap();
    assert_eq!(console_errors(&mut browser), Vec::<String>::new());
}

/// Percent-encodes what a URL path may not hold as it is.
fn percent_encode(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Kubernetes mode: the Host cache's hosts with their state, and changes to a Host (a
/// ramdisk's progress report, a cordon) in the open page as they happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubernetes_mode_lists_the_host_cache_and_follows_host_changes() {
    let lab = ProviderLab::start_with(Sims { count: 3, manual: 1 }, |_| {}).await.unwrap();
    let inspecting = lab.sims().into_iter().find(|s| s.mac() == provider::sim_mac(0)).unwrap();
    let token =
        wait::for_async("host-0's ramdisk token", PAGE_TIMEOUT, || async { inspecting.token() })
            .await
            .unwrap();
    // The browser's calls block: off the runtime's workers.
    let browse = |f: &mut dyn FnMut() -> anyhow::Result<Value>| tokio::task::block_in_place(f);
    let mut browser = tokio::task::block_in_place(|| Browser::start(&lab.lab)).unwrap();
    let url = format!("{}/", lab.siteboot.base_url());
    browse(&mut || browser.open(&url).map(|()| Value::Null)).unwrap();
    let states = "return [...document.querySelectorAll('tr.host')].map(r =>
                      [r.cells[0].textContent, r.cells[3].textContent, r.cells[5].textContent]);";
    let listed = browse(&mut || {
        browser.wait(
            "the three Hosts, one Inspecting",
            &format!(
                "const s = (() => {{ {states} }})();
                      return s.length === 3 && s[0][1] === 'Inspecting' ? s : null;"
            ),
            PAGE_TIMEOUT,
        )
    })
    .unwrap();
    assert_eq!(
        listed,
        json!([
            ["metal/host-0", "Inspecting", "Inspect"],
            ["metal/host-1", "Available", "—"],
            ["metal/host-2", "Available", "—"],
        ])
    );
    browse(&mut || browser.eval("window.sitebootTestMark = 'same page'; return null;")).unwrap();
    let role = browse(&mut || browser.eval("return document.getElementById('role').textContent;"));
    assert_eq!(role.unwrap(), "leader");

    // The ramdisk reports a step (markup in it): it shows as text, as an indeterminate bar.
    let step = "<script>window.pwned=1</script> reading disks";
    let (status, body) = inspecting
        .http("POST", "/agent/v1/progress", Some(&token), Some(&json!({ "step": step })))
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let imaging = browse(&mut || {
        browser.wait(
            "host-0's progress",
            &format!(
                "const r = {}; const p = r.querySelector('.imaging progress');
                 return r.cells[5].textContent.includes('reading disks') && p
                     ? {{ text: r.cells[5].textContent, indeterminate: !p.hasAttribute('value'),
                          scripts: document.querySelectorAll('body script').length,
                          pwned: window.pwned === undefined ? null : window.pwned }}
                     : null;",
                row(&provider::sim_mac(0))
            ),
            PAGE_TIMEOUT,
        )
    })
    .unwrap();
    assert_eq!(
        imaging,
        json!({ "text": format!("Inspect: {step}"), "indeterminate": true, "scripts": 0, "pwned": null })
    );

    // Byte counts make the bar determinate, with the percentage.
    let report = json!({ "step": "writing image", "bytes": { "done": 1 << 20, "total": 4 << 20 } });
    let (status, body) =
        inspecting.http("POST", "/agent/v1/progress", Some(&token), Some(&report)).unwrap();
    assert_eq!(status, 200, "{body}");
    let writing = browse(&mut || {
        browser.wait(
            "host-0's byte progress",
            &format!(
                "const r = {}; const p = r.querySelector('.imaging progress');
                 return p && p.hasAttribute('value')
                     ? {{ text: r.cells[5].textContent, value: p.value, max: p.max }} : null;",
                row(&provider::sim_mac(0))
            ),
            PAGE_TIMEOUT,
        )
    })
    .unwrap();
    assert_eq!(writing["value"], json!(1 << 20), "{writing}");
    assert_eq!(writing["max"], json!(4 << 20), "{writing}");
    assert!(writing["text"].as_str().unwrap().contains("writing image (25%"), "{writing}");

    // A claim shows as such, never who holds the host.
    let claim = json!({ "spec": { "consumerRef": { "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
        "kind": "SitebootMachine", "namespace": "metal", "name": "<b>worker-0</b>", "uid": "u-1" } } });
    lab.hosts().patch("host-1", &PatchParams::default(), &Patch::Merge(&claim)).await.unwrap();
    let consumer = browse(&mut || {
        browser.wait(
            "host-1's claim",
            &format!(
                "const c = {}.cells[4].textContent; return c === 'claimed' ? c : null;",
                row(&provider::sim_mac(1))
            ),
            PAGE_TIMEOUT,
        )
    })
    .unwrap();
    assert_eq!(consumer, "claimed");
    let page = browse(&mut || browser.eval("return document.body.textContent;")).unwrap();
    assert!(!page.as_str().unwrap().contains("worker-0"), "the tenant is shown: {page}");

    // A cordon shows in the state.
    let patch = json!({ "spec": { "maintenance": true } });
    lab.hosts().patch("host-2", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let cordoned = browse(&mut || {
        browser.wait(
            "host-2's cordon",
            &format!("const s = (() => {{ {states} }})(); return s[2][1].includes('maintenance') ? s[2] : null;"),
            PAGE_TIMEOUT,
        )
    })
    .unwrap();
    assert_eq!(cordoned, json!(["metal/host-2", "Available (maintenance)", "—"]));
    let mark = browse(&mut || browser.eval("return window.sitebootTestMark || null;")).unwrap();
    assert_eq!(mark, "same page", "the page reloaded");
    let errors = tokio::task::block_in_place(|| console_errors(&mut browser));
    assert_eq!(errors, Vec::<String>::new());
    tokio::task::block_in_place(|| drop(browser));
}
