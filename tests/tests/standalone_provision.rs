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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use siteboot_tests::appliance::{self, Appliance, BRIDGE, LAB_PROFILE, lab_config, lab_network};
use siteboot_tests::netns::Netns;
use siteboot_tests::sim::{Phase, SimHost};
use siteboot_tests::wait;

const MAC: &str = "52:54:00:00:5a:01";
const NAME: &str = "node-a";
const USER_DATA: &str = "#cloud-config\nhostname: node-a\nruncmd: [echo standalone]\n";
const STEP: Duration = Duration::from_secs(60);
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

/// Reboots `sim` and waits until it runs the ramdisk again, with a token: that boot's.
fn boot_ramdisk(sim: &SimHost) -> String {
    let boots = sim.boots();
    sim.reboot();
    wait::until("the host to boot the ramdisk with a token", STEP, POLL, || {
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
    let lab = lab_network(tag).unwrap();
    let mut config = lab_config("full");
    config.as_object_mut().unwrap().remove("unknown_hosts");
    config["profiles"]["disk"] = json!({ "local_boot": "exit" });
    config["ramdisk_profile"] = json!(LAB_PROFILE);
    config["hosts"] = hosts;
    let app = Appliance::start(&lab, config).unwrap();
    let config_path = dir.join("siteboot.yaml");
    std::fs::write(&config_path, app.config()).unwrap();
    std::fs::create_dir_all(app.http_root().join("lab")).unwrap();
    for file in ["vmlinuz", "initrd.img"] {
        std::fs::write(app.http_root().join("lab").join(file), b"not a kernel").unwrap();
    }
    (lab, app, config_path)
}

#[test]
fn a_listed_host_is_provisioned_and_wiped_without_kubernetes() {
    let dir = tempfile::tempdir().unwrap();
    let user_data = dir.path().join("node-a.user-data");
    std::fs::write(&user_data, USER_DATA).unwrap();
    let image = "siteboot standalone test image\n".repeat(4096);
    let checksum = format!("sha256:{:x}", Sha256::digest(image.as_bytes()));
    let url = format!("http://{}:{}/files/os.img", appliance::ADDRESS, appliance::HTTP_PORT);
    let hosts = json!([{
        "mac": MAC,
        "name": NAME,
        "profile": "disk",
        "image": { "url": url, "checksum": checksum },
        "user_data": user_data,
        "wipe": "full",
    }]);
    let (lab, mut app, config_path) = standalone_lab("standalone-prov", dir.path(), hosts);
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
    let provision = Cli::start(&config_path, &["provision", NAME]);
    provision.wait_for_line("Provision operation");
    let token = boot_ramdisk(&sim);
    let task = next_task(&sim, &token);
    assert_eq!(task["action"], "provision", "{task}");
    let operation = task["operation"].as_str().unwrap().to_owned();
    assert_eq!(
        task["metaData"],
        json!({
            "instance-id": operation,
            "local-hostname": NAME,
            "provider-id": format!("siteboot://standalone/{NAME}"),
        })
    );
    assert_eq!(task["image"]["checksum"], json!(checksum));
    assert_eq!(task["image"]["sizeBytes"], json!(image.len()));
    // The image is the cache's copy, served by digest.
    let url = task["image"]["url"].as_str().unwrap();
    let path = url.strip_prefix(app.base_url()).unwrap();
    assert_eq!(path, format!("/images/sha256/{}", checksum.trim_start_matches("sha256:")));
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
    assert_eq!(saved["installed"]["checksum"], json!(checksum));
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
