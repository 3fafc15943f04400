//! The appliance's container image (`scripts/build-image`): built reproducibly, it runs
//! `siteboot --version` and `check-config` on the examples it carries, and serves DHCP (UDP 67),
//! TFTP (UDP 69) and HTTP as its non-root user with no capabilities but NET_BIND_SERVICE and
//! NET_RAW (the ARP probe's packet socket).
//!
//! Run with rootful podman, `--network none` (the server test binds loopback only). The image is
//! built once per set of inputs (cached under `$SITEBOOT_CACHE/image/`); the first build compiles
//! the static release binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use siteboot_tests::process::Supervised;
use siteboot_tests::wait;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn run(command: &mut Command) -> Output {
    let output = command.output().unwrap_or_else(|e| panic!("running {command:?}: {e}"));
    eprintln!(
        "$ {command:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// `scripts/build-image`, once per test process: the image's name.
fn image() -> &'static str {
    static IMAGE: OnceLock<String> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let output = run(&mut Command::new(repo().join("scripts/build-image")));
        assert!(output.status.success(), "scripts/build-image failed");
        stdout(&output).lines().last().expect("the script prints the image name").to_owned()
    })
}

fn image_id(name: &str) -> String {
    let output =
        run(Command::new("podman").args(["image", "inspect", "--format", "{{.Id}}", name]));
    assert!(output.status.success());
    stdout(&output)
}

/// `podman run --rm --network none` with what this machine allows: runc (crun 1.8 refuses
/// hosts with cgroup v1 controllers next to cgroup v2), and resource limits at most this
/// process's own (podman's defaults for root are higher, and raising a hard limit needs
/// CAP_SYS_RESOURCE, which a sandboxed root may lack).
fn podman_run() -> Command {
    // SAFETY: getrlimit writes into the struct we pass.
    let nofile = unsafe {
        let mut limit = std::mem::zeroed::<libc::rlimit>();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_max
    };
    let mut command = Command::new("podman");
    command.args(["--runtime", "runc", "run", "--rm", "--network", "none"]);
    command.arg(format!("--ulimit=nofile={nofile}:{nofile}"));
    // The appliance's threads count against it; it needs a few dozen.
    command.arg("--ulimit=nproc=4096:4096");
    command
}

/// `podman run` with exactly the capabilities the Deployment grants (podman's defaults lack
/// NET_RAW, without which the binary's file capabilities refuse the exec).
fn podman_run_as_deployed() -> Command {
    let mut command = podman_run();
    command.args(["--cap-drop=ALL", "--cap-add=NET_BIND_SERVICE", "--cap-add=NET_RAW"]);
    command
}

#[test]
fn the_image_is_reproducible() {
    let name = image();
    let cached = image_id(name);
    // Build again from the same inputs into a fresh folder, ignoring the cache.
    let out = tempfile::tempdir().unwrap();
    let output = run(Command::new(repo().join("scripts/build-image")).arg("--out").arg(out.path()));
    assert!(output.status.success(), "second build failed");
    assert_eq!(stdout(&output).lines().last(), Some(name));
    let rebuilt = std::fs::read_to_string(out.path().join("image-id")).unwrap();
    assert_eq!(rebuilt.trim(), cached, "same inputs, another image");
    assert_eq!(image_id(name), cached);
    // Nothing of the build time: the image says it was created at SOURCE_DATE_EPOCH (0).
    let created = run(Command::new("podman").args([
        "image",
        "inspect",
        "--format",
        "{{.Created.Unix}} {{.Config.User}} {{len .History}}",
        name,
    ]));
    assert_eq!(stdout(&created), "0 65532:65532 0");
}

#[test]
fn version_and_check_config_run_in_the_image() {
    let name = image();
    let version = run(podman_run_as_deployed().args([name, "--version"]));
    assert!(version.status.success());
    assert_eq!(stdout(&version), format!("siteboot {}", env!("CARGO_PKG_VERSION")));
    // What `siteboot manifests` puts in its Deployments unless given --image.
    assert_eq!(name, siteboot_controller::manifests::default_image());

    // The examples the image carries pass against the iPXE binaries the image carries.
    let checked = run(podman_run_as_deployed().args([
        name,
        "check-config",
        "/usr/share/siteboot/examples/standalone.yaml",
    ]));
    assert!(checked.status.success());
    assert_eq!(
        stdout(&checked),
        "/usr/share/siteboot/examples/standalone.yaml: ok (full DHCP, 3 known hosts, iPXE \
         binaries for bios, uefi-x64)"
    );
    let checked = run(podman_run_as_deployed().args([
        name,
        "check-config",
        "/usr/share/siteboot/examples/kubernetes.yaml",
    ]));
    assert!(checked.status.success());
    assert!(
        stdout(&checked)
            .ends_with(": ok (full DHCP, 0 known hosts, iPXE binaries for bios, uefi-x64)")
    );

    // The config of the Deployment `siteboot manifests` writes passes in the image it names.
    let site = siteboot_controller::manifests::ApplianceSite::example(name);
    let objects = siteboot_controller::manifests::appliance(&site);
    let (config_map, deployment) = (&objects[0], &objects[1]);
    assert_eq!(deployment["spec"]["template"]["spec"]["containers"][0]["image"], name);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("siteboot.yaml");
    // It leaves the address to the node's eth1, which the container has not: give it one.
    let site_config = config_map["data"]["siteboot.yaml"].as_str().unwrap();
    let site_config =
        site_config.replacen("interface: eth1\n", "interface: eth1\naddress: 10.99.0.2\n", 1);
    std::fs::write(&config, site_config).unwrap();
    let checked = run(podman_run_as_deployed()
        .arg(format!("--volume={}:/etc/siteboot/siteboot.yaml:ro", config.display()))
        .args([name, "check-config", "/etc/siteboot/siteboot.yaml"]));
    assert!(checked.status.success());

    // A config from outside that the image cannot satisfy fails, naming the field.
    std::fs::write(
        &config,
        loopback_config().replace("profiles:", "tftp:\n  ipxe_dir: /nowhere\nprofiles:"),
    )
    .unwrap();
    let refused = run(podman_run_as_deployed()
        .arg(format!("--volume={}:/etc/siteboot/siteboot.yaml:ro", config.display()))
        .args([name, "check-config", "/etc/siteboot/siteboot.yaml"]));
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("tftp.ipxe_dir"));
}

/// Full DHCP, TFTP and HTTP on the container's loopback.
fn loopback_config() -> String {
    "\
interface: lo
address: 127.0.0.1
state_dir: /var/lib/siteboot
dhcp:
  mode: full
  subnets:
    - subnet: 127.0.0.0/8
      pools: [127.0.0.100-127.0.0.199]
http:
  port: 8080
  https_port: 8443
  root: /srv/siteboot
profiles:
  disk:
    local_boot: exit
"
    .to_owned()
}

/// Removes the container when the test ends, however it ends.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("podman").args(["rm", "--force", "--ignore", &self.0]).output();
    }
}

#[test]
fn it_serves_as_its_non_root_user_with_net_bind_service_and_net_raw_only() {
    let name = image();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("siteboot.yaml");
    std::fs::write(&config, loopback_config()).unwrap();
    let volume = format!("--volume={}:/etc/siteboot/siteboot.yaml:ro", config.display());

    // The binary carries the capabilities, so that a non-root exec gets them (where the runtime
    // sets no ambient capabilities, as Kubernetes' do not).
    let mounted = run(Command::new("podman").args(["image", "mount", name]));
    assert!(mounted.status.success());
    let getcap =
        run(Command::new("getcap").arg(Path::new(&stdout(&mounted)).join("usr/bin/siteboot")));
    run(Command::new("podman").args(["image", "unmount", name]));
    assert!(
        stdout(&getcap).ends_with("cap_net_bind_service,cap_net_raw=ep"),
        "{}",
        stdout(&getcap)
    );

    // Without both in the bounding set the kernel refuses to run a binary whose file
    // capabilities it cannot grant: the Deployment must keep them.
    for kept in [&[][..], &["--cap-add=NET_BIND_SERVICE"], &["--cap-add=NET_RAW"]] {
        let refused = run(podman_run().arg("--cap-drop=ALL").args(kept).args([&volume, name]));
        assert!(!refused.status.success(), "ran with only {kept:?}");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("operation not permitted"), "{kept:?}: {stderr}");
    }

    let container = Container(format!("sbt-image-{}", std::process::id()));
    let mut serve = podman_run_as_deployed();
    serve.args(["--name", &container.0, &volume]);
    serve.arg(name);
    let mut server = Supervised::spawn("siteboot-in-podman", &mut serve, dir.path()).unwrap();
    wait::for_("siteboot to serve in the container", Duration::from_secs(60), || {
        assert!(server.try_wait().is_none(), "the container exited:\n{}", server.log());
        server.log().contains("siteboot serving").then_some(())
    })
    .unwrap();
    // "serving" comes after the DHCP (67, 4011), TFTP (69) and HTTP sockets are bound.
    let user = run(Command::new("podman").args(["top", &container.0, "user", "huser"]));
    assert!(user.status.success());
    let processes: Vec<Vec<String>> = stdout(&user)
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().map(str::to_owned).collect())
        .collect();
    assert_eq!(
        processes,
        [["siteboot", "65532"]],
        "the server's user in the container, on the host"
    );

    let stopped = run(Command::new("podman").args(["stop", "--time", "20", &container.0]));
    assert!(stopped.status.success());
    let status = server.wait_timeout(Duration::from_secs(30)).unwrap();
    assert!(status.success(), "{status}: {}", server.log());
    // It wrote its lease file into the state directory the image gives its user.
    assert!(server.log().contains("lease file written"), "{}", server.log());
}
