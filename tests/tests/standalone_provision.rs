//! Provisioning without Kubernetes: a standalone appliance with a host listed in its config
//! (image, user_data, wipe, ramdisk_profile), `siteboot host provision|deprovision|list`
//! against it, and a simulated host whose ramdisk the test drives over the agent API. It proves
//! the host boots its profile until an operation starts and the ramdisk (with a token) while it
//! runs; the CLI prints the ramdisk's progress and ends with the result and exit status; a
//! wrong token is refused and the bootstrap data goes out once; the served image is the
//! cache's verified copy; an appliance killed mid-operation (SIGKILL) carries the operation,
//! the token and "delivered" over; a provisioned host stays wipe-required until a deprovision
//! succeeds. A second test runs an inspection with the simulated ramdisk on its own.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use siteboot_tests::appliance::{self, Appliance, BRIDGE, LAB_PROFILE, lab_config, lab_network};
use siteboot_tests::initramfs;
use siteboot_tests::netns::Netns;
use siteboot_tests::redfish::{Libvirt, Sushy, SushyOptions, free_port};
use siteboot_tests::sim::{Phase, SimHost};
use siteboot_tests::wait;

const MAC: &str = "52:54:00:00:5a:01";
const NAME: &str = "node-a";
const USER_DATA: &str = "#cloud-config\nhostname: node-a\nruncmd: [echo standalone]\n";
const STEP: Duration = Duration::from_secs(60);
/// The BMC's only user.
const BMC_USER: (&str, &str) = ("admin", "correct horse");
/// From power-on to the test ramdisk's callback: ~30 s under TCG; generous for CI.
const BMC_BOOT_TIMEOUT: Duration = Duration::from_secs(240);
const POLL: Duration = Duration::from_millis(200);

/// A `siteboot host ...` command running in the background, its stdout collected.
struct Cli {
    child: Child,
    out: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Cli {
    fn start(config: &Path, args: &[&str]) -> Cli {
        let mut child = Command::new(appliance::binary().unwrap())
            .arg("host")
            .args(args)
            .arg("--config")
            .arg(config)
            .args(["--timeout", "180s"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().unwrap();
        let lines = out.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Cli { child, out, reader: Some(reader) }
    }

    fn output(&self) -> String {
        self.out.lock().unwrap().join("\n")
    }

    fn wait_for_line(&self, what: &str) {
        wait::until(&format!("the CLI to print {what:?}"), STEP, POLL, || {
            self.output().contains(what).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\nCLI output:\n{}", self.output()));
    }

    /// Waits for the command to end: (success, stdout, stderr).
    fn finish(mut self) -> (bool, String, String) {
        let status = wait::until("the CLI to exit", STEP, POLL, || self.child.try_wait().unwrap())
            .unwrap_or_else(|e| panic!("{e}\nCLI output:\n{}", self.output()));
        self.reader.take().unwrap().join().unwrap();
        let mut stderr = String::new();
        std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        (status.success(), self.output(), stderr)
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs a `siteboot host ...` command to its end: (success, stdout, stderr).
fn cli(config: &Path, args: &[&str]) -> (bool, String, String) {
    Cli::start(config, args).finish()
}

/// Reboots `sim` and waits until it runs the ramdisk again, with a token: that boot's. The
/// CLI starts the operation while the host reboots, so the host may fetch its script first and
/// boot its disk: then it is power-cycled again, as an operator would.
fn boot_ramdisk(sim: &SimHost) -> String {
    let mut boots = sim.boots();
    sim.reboot();
    wait::until("the host to boot the ramdisk with a token", STEP, POLL, || {
        if sim.boots() > boots && sim.phase() == Phase::Os {
            boots = sim.boots();
            sim.reboot();
            return None;
        }
        (sim.boots() > boots && sim.phase() == Phase::Ramdisk).then(|| sim.token()).flatten()
    })
    .unwrap()
}

/// `GET task` until the ramdisk is given something other than "wait".
fn next_task(sim: &SimHost, token: &str) -> Value {
    wait::until("a task other than wait", STEP, Duration::from_millis(500), || {
        let (status, body) = sim.http("GET", "/agent/v1/task", Some(token), None).unwrap();
        assert_eq!(status, 200, "{body}");
        let task: Value = serde_json::from_str(&body).unwrap();
        (task["action"] != "wait").then_some(task)
    })
    .unwrap()
}

/// Starts `siteboot host provision <host>` and boots `sim` into the ramdisk: (the CLI
/// following the operation, the ramdisk's token, its provision task).
fn provision_until_task(config: &Path, host: &str, sim: &SimHost) -> (Cli, String, Value) {
    let provision = Cli::start(config, &["provision", host]);
    provision.wait_for_line("Provision operation");
    let token = boot_ramdisk(sim);
    let task = next_task(sim, &token);
    assert_eq!(task["action"], "provision", "{task}");
    (provision, token, task)
}

fn post(sim: &SimHost, path: &str, token: &str, body: Value) -> (u16, String) {
    sim.http("POST", path, Some(token), Some(&body)).unwrap()
}

fn record(app: &Appliance) -> Value {
    let path = app.state_dir().join(format!("hosts/{}.json", appliance::mac_dashed(MAC)));
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn listed_state(config: &Path) -> String {
    let (ok, out, err) = cli(config, &["list"]);
    assert!(ok, "host list failed: {err}");
    let line = out.lines().find(|l| l.starts_with(NAME)).unwrap_or_else(|| panic!("{out}"));
    line.split_whitespace().nth(2).unwrap().to_owned()
}

/// A lab with a standalone appliance whose config lists `hosts` (profiles `disk`, the local
/// disk, and the lab's, the ramdisk) and fake ramdisk files to fetch; the config file
/// `siteboot host` reads is in `dir`.
fn standalone_lab(tag: &str, dir: &Path, hosts: Value) -> (Netns, Appliance, PathBuf) {
    standalone_lab_with(lab_network(tag).unwrap(), dir, hosts, |_| {})
}

/// [`standalone_lab`] in `lab`, with `configure` applied to the config.
fn standalone_lab_with(
    lab: Netns,
    dir: &Path,
    hosts: Value,
    configure: impl FnOnce(&mut Value),
) -> (Netns, Appliance, PathBuf) {
    let mut config = lab_config("full");
    config.as_object_mut().unwrap().remove("unknown_hosts");
    config["profiles"]["disk"] = json!({ "local_boot": "exit" });
    config["ramdisk_profile"] = json!(LAB_PROFILE);
    config["hosts"] = hosts;
    configure(&mut config);
    let app = Appliance::start(&lab, config).unwrap();
    let config_path = dir.join("siteboot.yaml");
    std::fs::write(&config_path, app.config()).unwrap();
    std::fs::create_dir_all(app.http_root().join("lab")).unwrap();
    for file in ["vmlinuz", "initrd.img"] {
        std::fs::write(app.http_root().join("lab").join(file), b"not a kernel").unwrap();
    }
    (lab, app, config_path)
}

/// The image [`provisionable`] hosts get, served as `http.root/os.img`.
fn image() -> String {
    "siteboot standalone test image\n".repeat(4096)
}

/// `hosts` with one host to provision: [`image`] (write it to `http.root/os.img`), user-data
/// in `dir`, `wipe: full`.
fn provisionable(dir: &Path) -> Value {
    let user_data = dir.join("node-a.user-data");
    std::fs::write(&user_data, USER_DATA).unwrap();
    let checksum = format!("sha256:{:x}", Sha256::digest(image().as_bytes()));
    let url = format!("http://{}:{}/files/os.img", appliance::ADDRESS, appliance::HTTP_PORT);
    json!([{
        "mac": MAC,
        "name": NAME,
        "profile": "disk",
        "image": { "url": url, "checksum": checksum },
        "user_data": user_data,
        "wipe": "full",
    }])
}

#[test]
fn a_listed_host_is_provisioned_and_wiped_without_kubernetes() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = provisionable(dir.path());
    let (image, checksum) = (image(), hosts[0]["image"]["checksum"].clone());
    let (lab, app, config_path) = standalone_lab("standalone-prov", dir.path(), hosts);
    std::fs::write(app.http_root().join("os.img"), &image).unwrap();

    let sim = SimHost::start_manual(&lab, BRIDGE, MAC, app.base_url()).unwrap();
    // On failure, dropping `app` and `sim` prints the appliance's log and the host's.
    // No operation: the host boots its profile (the local disk).
    wait::until("the host to boot its disk", STEP, POLL, || {
        (sim.phase() == Phase::Os).then_some(())
    })
    .unwrap();
    assert_eq!(listed_state(&config_path), "Available");

    // Provision: the CLI starts the operation and follows it.
    let (provision, token, task) = provision_until_task(&config_path, NAME, &sim);
    let operation = task["operation"].as_str().unwrap().to_owned();
    assert_eq!(
        task["metaData"],
        json!({
            "instance-id": operation,
            "local-hostname": NAME,
            "provider-id": format!("siteboot://standalone/{NAME}"),
        })
    );
    assert_eq!(task["image"]["checksum"], checksum);
    assert_eq!(task["image"]["sizeBytes"], json!(image.len()));
    // The image is the cache's copy, served by digest.
    let url = task["image"]["url"].as_str().unwrap();
    let path = url.strip_prefix(app.base_url()).unwrap();
    let digest = checksum.as_str().unwrap().trim_start_matches("sha256:");
    assert_eq!(path, format!("/images/sha256/{digest}"));
    let (status, served) = sim.http_plain("GET", path, None).unwrap();
    assert_eq!((status, served == image), (200, true));

    // A wrong token is refused; the right one gets the user-data once.
    let wrong = "ab".repeat(32);
    let (status, body) = sim.http("GET", "/agent/v1/bootstrap", Some(&wrong), None).unwrap();
    assert_eq!((status, body.as_str()), (403, "refused: wrong token\n"));
    let (status, body) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, body.as_str()), (200, USER_DATA));
    let (status, body) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!(status, 409, "{body}");

    let total = image.len() as u64;
    let progress =
        |done: u64| json!({ "step": "writing image", "bytes": { "done": done, "total": total } });
    assert_eq!(post(&sim, "/agent/v1/progress", &token, progress(total / 4)).0, 200);
    provision.wait_for_line("writing image");
    provision.wait_for_line("(25%)");

    // The appliance crashes mid-operation: the operation, its token and "delivered" survive.
    app.kill9();
    app.restart().unwrap();
    let (status, body) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!(status, 409, "still delivered after the restart: {body}");
    assert_eq!(post(&sim, "/agent/v1/progress", &token, progress(total * 3 / 4)).0, 200);
    provision.wait_for_line("(75%)");
    assert_eq!(post(&sim, "/agent/v1/complete", &token, json!({ "ok": true })).0, 200);
    let (ok, out, err) = provision.finish();
    assert!(ok, "provision failed:\n{out}\n{err}");
    assert!(out.contains("Provision succeeded; now Provisioned"), "{out}");
    assert!(out.contains("MiB/s"), "a rate is shown: {out}");

    let saved = record(&app);
    assert_eq!(saved["wipe_required"], json!(true));
    assert_eq!(saved["installed"]["checksum"], checksum);
    assert_eq!(listed_state(&config_path), "Provisioned");
    // The token ended with the operation; the host boots its disk again.
    let (status, body) = post(&sim, "/agent/v1/progress", &token, progress(total));
    assert_eq!((status, body.as_str()), (403, "refused: no operation in progress\n"));
    // The agent that finished is told to reboot (into the disk), not to wait for ever.
    let (status, body) = sim.http("GET", "/agent/v1/task", Some(&token), None).unwrap();
    assert_eq!((status, body.as_str()), (200, r#"{"action":"reboot"}"#));
    let boots = sim.boots();
    sim.reboot();
    wait::until("the provisioned host to boot its disk", STEP, POLL, || {
        (sim.boots() > boots && sim.phase() == Phase::Os).then_some(())
    })
    .unwrap();

    // Provisioned and not wiped: a new provisioning must wait for a deprovision.
    let (ok, _, err) = cli(&config_path, &["provision", NAME]);
    assert!(!ok && err.contains("deprovision it first"), "{err}");

    // A wipe that fails leaves the host wipe-required, with the ramdisk's reason.
    let deprovision = Cli::start(&config_path, &["deprovision", NAME]);
    let token = boot_ramdisk(&sim);
    let task = next_task(&sim, &token);
    assert_eq!(
        (task["action"].as_str(), task["wipe"].as_str()),
        (Some("deprovision"), Some("full"))
    );
    let (status, body) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, body.as_str()), (403, "refused: not allowed during Deprovision\n"));
    let failed = json!({ "ok": false, "message": "wiping /dev/sda: I/O error" });
    assert_eq!(post(&sim, "/agent/v1/complete", &token, failed).0, 200);
    let (ok, _, err) = deprovision.finish();
    assert!(!ok && err.contains("Deprovision failed: wiping /dev/sda: I/O error"), "{err}");
    assert_eq!(record(&app)["wipe_required"], json!(true));

    // Again, successfully: the host is available.
    let deprovision = Cli::start(&config_path, &["deprovision", NAME]);
    let token = boot_ramdisk(&sim);
    assert_eq!(next_task(&sim, &token)["action"], "deprovision");
    assert_eq!(post(&sim, "/agent/v1/progress", &token, json!({ "step": "wiping" })).0, 200);
    deprovision.wait_for_line("wiping");
    assert_eq!(post(&sim, "/agent/v1/complete", &token, json!({ "ok": true })).0, 200);
    let (ok, out, err) = deprovision.finish();
    assert!(ok, "deprovision failed:\n{out}\n{err}");
    assert_eq!(record(&app)["wipe_required"], json!(false));
    assert_eq!(listed_state(&config_path), "Available");
}

/// `siteboot host inspect` with the simulated ramdisk running on its own (as the real agent
/// does): the hardware it reports is recorded, and a host not listed is refused.
#[test]
fn a_listed_host_is_inspected_by_a_ramdisk_that_runs_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = json!([{ "mac": MAC, "name": NAME, "profile": "disk" }]);
    let (lab, app, config_path) = standalone_lab("standalone-insp", dir.path(), hosts);
    let sim = SimHost::start(&lab, BRIDGE, MAC, app.base_url()).unwrap();
    wait::until("the host to boot its disk", STEP, POLL, || {
        (sim.phase() == Phase::Os).then_some(())
    })
    .unwrap();

    let (ok, _, err) = cli(&config_path, &["inspect", "nosuch"]);
    assert!(!ok && err.contains("no host named \"nosuch\""), "{err}");
    let (ok, _, err) = cli(&config_path, &["provision", NAME]);
    assert!(!ok && err.contains("has no image"), "{err}");

    let inspect = Cli::start(&config_path, &["inspect", NAME]);
    inspect.wait_for_line("Inspect operation");
    sim.reboot();
    let (ok, out, err) = inspect.finish();
    assert!(ok, "inspect failed:\n{out}\n{err}");
    assert!(out.contains("Inspect succeeded; now Available"), "{out}");
    let saved = record(&app);
    assert_eq!(saved["hardware"]["cpus"], json!(4), "{saved}");
    assert_eq!(saved["hardware"]["nics"][0]["mac"], json!(MAC), "{saved}");
    assert_eq!(saved["wipe_required"], json!(false), "inspection writes nothing");
    // With the operation over, the ramdisk is told to wait, and the host boots its disk again.
    sim.reboot();
    wait::until("the inspected host to boot its disk", STEP, POLL, || {
        (sim.phase() == Phase::Os).then_some(())
    })
    .unwrap();
}

/// The `host list` line of the test's host: state and last result.
fn listed_line(config: &Path) -> String {
    let (ok, out, err) = cli(config, &["list"]);
    assert!(ok, "host list failed: {err}");
    out.lines().find(|l| l.starts_with(NAME)).unwrap_or_else(|| panic!("{out}")).to_owned()
}

/// A ramdisk that booted, reported a step and then fell silent for longer than
/// `ramdisk_silence_timeout` ends its operation as failed, with the reason in the CLI, `host
/// list` and the log; its token then gets neither bootstrap data nor a task.
#[test]
fn a_silent_ramdisk_fails_its_operation_and_loses_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let lab = lab_network("standalone-silent").unwrap();
    let hosts = provisionable(dir.path());
    let (lab, app, config_path) = standalone_lab_with(lab, dir.path(), hosts, |config| {
        config["ramdisk_silence_timeout"] = json!("8s");
    });
    std::fs::write(app.http_root().join("os.img"), image()).unwrap();
    let sim = SimHost::start_manual(&lab, BRIDGE, MAC, app.base_url()).unwrap();

    let (provision, token, task) = provision_until_task(&config_path, NAME, &sim);
    let operation = task["operation"].as_str().unwrap().to_owned();
    let step = json!({ "step": "writing image" });
    assert_eq!(post(&sim, "/agent/v1/progress", &token, step).0, 200);
    provision.wait_for_line("writing image");

    // Nothing more from the ramdisk: the operation ends with the reason.
    let (ok, out, err) = provision.finish();
    let reason = format!(
        "ramdisk silent for more than 8s during Provision operation {operation} (its last step: writing image)"
    );
    assert!(!ok && err.contains(&format!("Provision failed: {reason}")), "{out}\n{err}");
    let line = listed_line(&config_path);
    assert!(line.contains("WipeRequired") && line.contains(&reason), "{line}");
    assert!(app.log().contains(&reason), "the log says why");
    let saved = record(&app);
    assert_eq!(saved["operation"], Value::Null);
    assert_eq!(saved["last"]["message"], json!(reason));

    // The ramdisk comes back with its old token: nothing for it.
    let (status, body) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, body.as_str()), (403, "refused: no operation in progress\n"));
    let (status, body) = sim.http("GET", "/agent/v1/task", Some(&token), None).unwrap();
    assert_eq!((status, body.as_str()), (200, r#"{"action":"wait","seconds":10}"#));
    let (status, _) = post(&sim, "/agent/v1/complete", &token, json!({ "ok": true }));
    assert_eq!(status, 403);
    assert_eq!(listed_state(&config_path), "WipeRequired", "never Provisioned");
    assert!(sim.bootstrap_data().is_empty());
}

/// `siteboot host cancel` ends a provisioning after its bootstrap data went out: the token
/// stops working (a late "done" cannot make the host Provisioned), the record says who ended
/// it, the follower exits 1 with it, and the host boots its profile again. Hosts are named by
/// name or MAC; unknown hosts and hosts with nothing to cancel are refused.
#[test]
fn an_operator_cancels_a_provisioning() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = provisionable(dir.path());
    let (lab, app, config_path) = standalone_lab("standalone-cancel", dir.path(), hosts);
    std::fs::write(app.http_root().join("os.img"), image()).unwrap();
    let sim = SimHost::start_manual(&lab, BRIDGE, MAC, app.base_url()).unwrap();

    let (ok, _, err) = cli(&config_path, &["cancel", NAME]);
    assert!(!ok && err.contains("host \"node-a\" has no operation under way"), "{err}");
    let (ok, _, err) = cli(&config_path, &["cancel", "nosuch"]);
    assert!(!ok && err.contains("no host named \"nosuch\""), "{err}");

    let (provision, token, task) = provision_until_task(&config_path, MAC, &sim);
    let operation = task["operation"].as_str().unwrap().to_owned();
    let (status, body) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, body.as_str()), (200, USER_DATA));

    let (ok, out, err) = cli(&config_path, &["cancel", NAME]);
    assert!(ok, "cancel failed: {out}\n{err}");
    assert!(
        out.contains(&format!(
            "node-a: Provision operation {operation} cancelled; now WipeRequired"
        )),
        "{out}"
    );
    let (ok, out, err) = provision.finish();
    assert!(!ok && err.contains("Provision failed: cancelled by operator"), "{out}\n{err}");
    let saved = record(&app);
    assert_eq!(saved["operation"], Value::Null);
    assert_eq!(saved["last"]["message"], json!("cancelled by operator"));
    assert_eq!(saved["installed"], Value::Null);
    assert_eq!(saved["wipe_required"], json!(true), "the ramdisk may have written the disk");

    let (status, _) = post(&sim, "/agent/v1/complete", &token, json!({ "ok": true }));
    assert_eq!(status, 403, "a late success is refused");
    let (status, _) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!(status, 403);
    assert_eq!(listed_state(&config_path), "WipeRequired");
    let (ok, _, err) = cli(&config_path, &["cancel", MAC]);
    assert!(!ok && err.contains("host \"node-a\" has no operation under way"), "{err}");
    // Starting again means wiping first.
    let (ok, _, err) = cli(&config_path, &["provision", NAME]);
    assert!(!ok && err.contains("deprovision it first"), "{err}");

    let boots = sim.boots();
    sim.reboot();
    wait::until("the host to boot its disk again", STEP, POLL, || {
        (sim.boots() > boots && sim.phase() == Phase::Os).then_some(())
    })
    .unwrap();
}

/// A listed host with a Redfish BMC (sushy-tools driving a libvirt/QEMU VM whose disk is
/// empty): `siteboot host inspect` checks the BMC, then boots the powered-off VM once from the
/// network, and only that boot reaches the ramdisk (with the operation's token). A BMC with
/// the wrong password, one that manages another machine and one that does not answer fail the
/// command with the reason and start nothing.
#[test]
fn a_host_with_a_bmc_is_booted_into_the_ramdisk_through_it() {
    const VM: &str = "52:54:00:00:5a:11";
    let boot = initramfs::boot_files().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lab = lab_network("standalone-bmc").unwrap();
    let libvirt = Libvirt::start(&lab).unwrap();
    let domain = libvirt.define("siteboot-standalone-bmc", VM, BRIDGE).unwrap();
    let sushy =
        Sushy::start(SushyOptions { user: BMC_USER, tls: None, netns: Some(&lab) }).unwrap();
    let credentials = |file: &str, password: &str| {
        let path = dir.path().join(file);
        std::fs::write(&path, format!("username: {}\npassword: '{password}'\n", BMC_USER.0))
            .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let (good, wrong) = (credentials("good.yaml", BMC_USER.1), credentials("wrong.yaml", "nope"));
    let address = sushy.address(&domain);
    let nobody = format!("redfish+http://127.0.0.1:{}/redfish/v1/Systems/1", free_port().unwrap());
    let host = |mac: &str, name: &str, address: &str, credentials: &Path| {
        json!({
            "mac": mac, "name": name, "profile": "disk",
            "bmc": { "address": address, "credentials_file": credentials },
        })
    };
    let hosts = json!([
        host(VM, "vm", &address, &good),
        host("52:54:00:00:5a:12", "wrong-password", &address, &wrong),
        host("52:54:00:00:5a:13", "other-machine", &address, &good),
        host("52:54:00:00:5a:14", "no-bmc-there", &nobody, &good),
    ]);
    let (_lab, app, config_path) = standalone_lab_with(lab, dir.path(), hosts, |_| {});
    app.install_boot_files(&boot).unwrap();

    for (name, reason) in [
        ("wrong-password", "refused the credentials (wrong username or password?)"),
        ("other-machine", &format!("has NICs {VM}, not the boot MAC 52:54:00:00:5a:13")),
        ("no-bmc-there", "is unreachable after 4 attempt(s)"),
    ] {
        let (ok, out, err) = cli(&config_path, &["inspect", name]);
        assert!(!ok && err.contains(reason), "{name}: {out}\n{err}");
        assert!(err.contains(&format!("host \"{name}\": the BMC")), "{err}");
        let line = {
            let (_, list, _) = cli(&config_path, &["list"]);
            list.lines().find(|l| l.starts_with(name)).unwrap().to_owned()
        };
        assert!(line.contains("Available") && line.ends_with(" -"), "nothing started: {line}");
    }
    assert_eq!(libvirt.state(&domain).unwrap(), "shut off", "no BMC call powered the VM on");

    let inspect = Cli::start(&config_path, &["inspect", "vm"]);
    inspect.wait_for_line(&format!(
        "started; network boot through the BMC at {}",
        address.trim_start_matches("redfish+http://").split('/').next().unwrap()
    ));
    // The disk is empty: only the network boot, into the ramdisk, reaches the callback.
    let marker = domain.wait_for_console("SITEBOOT-TEST: callback", BMC_BOOT_TIMEOUT).unwrap();
    assert_eq!(marker, "SITEBOOT-TEST: callback ok");
    let saved: Value = serde_json::from_slice(
        &std::fs::read(app.state_dir().join(format!("hosts/{}.json", appliance::mac_dashed(VM))))
            .unwrap(),
    )
    .unwrap();
    assert!(saved["operation"]["token_issued"].is_u64(), "the ramdisk got a token: {saved}");
    inspect.wait_for_line("vm: the ramdisk booted");
    // The test ramdisk has no agent: end the operation by hand.
    let (ok, out, err) = cli(&config_path, &["cancel", "vm"]);
    assert!(ok, "{out}\n{err}");
    let (ok, _, err) = inspect.finish();
    assert!(!ok && err.contains("Inspect failed: cancelled by operator"), "{err}");
}
