//! The front door: `siteboot check-config` on the README's example, run on a machine that has
//! none of the example's directories yet, as the built binary (no root, nothing served).

use std::path::Path;
use std::process::Output;

/// examples/standalone.yaml, with its directories moved into `dir`: the iPXE binaries present,
/// `http.root` (`dir/www`) not created, the state directory where nothing else is.
fn fresh_machine_example(dir: &Path) -> std::path::PathBuf {
    let ipxe = dir.join("ipxe");
    std::fs::create_dir(&ipxe).unwrap();
    for binary in ["undionly.kpxe", "snponly.efi"] {
        std::fs::write(ipxe.join(binary), b"x").unwrap();
    }
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/standalone.yaml");
    let text = std::fs::read_to_string(example).unwrap();
    for shown in ["ipxe_dir: /usr/lib/ipxe", "root: /srv/siteboot", "state_dir: /var/lib/siteboot"]
    {
        assert!(text.contains(shown), "the example shows {shown}");
    }
    let text = text
        .replace("/usr/lib/ipxe", ipxe.to_str().unwrap())
        .replace("/srv/siteboot", dir.join("www").to_str().unwrap())
        .replace("/var/lib/siteboot", dir.join("state").to_str().unwrap());
    let file = dir.join("standalone.yaml");
    std::fs::write(&file, text).unwrap();
    file
}

fn siteboot(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_siteboot"))
        .args(args)
        .env_remove("SITEBOOT_LOG")
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).unwrap()
}

/// The example is valid though its `http.root` is not there yet: check-config passes and says
/// what `serve` needs, and `serve` refuses to start without it.
#[test]
fn the_example_passes_on_a_machine_without_its_http_root() {
    let dir = tempfile::tempdir().unwrap();
    let file = fresh_machine_example(dir.path());
    let (file, www) = (file.to_str().unwrap(), dir.path().join("www"));
    let missing = format!(
        "{file}: http.root: {}: no such directory (create it, or point http.root elsewhere)",
        www.display()
    );

    let checked = siteboot(&["check-config", file]);
    assert_eq!(checked.status.code(), Some(0), "{}", text(&checked.stderr));
    assert_eq!(
        text(&checked.stdout),
        format!("{file}: ok (full DHCP, 3 known hosts, iPXE binaries for bios, uefi-x64)\n")
    );
    assert_eq!(
        text(&checked.stderr),
        format!("warning: {missing}; the configuration is valid, but `siteboot serve` needs it\n")
    );

    let served = siteboot(&["serve", "--config", file]);
    assert_eq!(served.status.code(), Some(1), "{}", text(&served.stderr));
    assert_eq!(text(&served.stderr), format!("error: {missing}\n"));

    std::fs::create_dir(&www).unwrap();
    let checked = siteboot(&["check-config", file]);
    assert_eq!(checked.status.code(), Some(0));
    assert_eq!(text(&checked.stderr), "", "nothing missing, nothing to warn of");
}

/// What is wrong with the file itself, or with what is at its paths, still fails.
#[test]
fn a_malformed_config_or_a_root_that_is_no_directory_fails() {
    let dir = tempfile::tempdir().unwrap();
    let file = fresh_machine_example(dir.path());
    let example = std::fs::read_to_string(&file).unwrap();
    let www = dir.path().join("www");
    std::fs::write(&www, b"not a directory").unwrap();
    let file = file.to_str().unwrap();
    let not_dir = format!("error: {file}: http.root: {} is not a directory\n", www.display());
    let checked = siteboot(&["check-config", file]);
    assert_eq!((checked.status.code(), text(&checked.stderr)), (Some(1), not_dir.as_str()));

    std::fs::remove_file(&www).unwrap();
    assert!(example.contains("  port: 8080\n"));
    std::fs::write(file, example.replace("  port: 8080\n", "  port: 0\n")).unwrap();
    let checked = siteboot(&["check-config", file]);
    let bad_port = format!("error: {file}: http.port: must be 1-65535\n");
    assert_eq!((checked.status.code(), text(&checked.stderr)), (Some(1), bad_port.as_str()));
    assert_eq!(text(&checked.stdout), "");
}
