//! Real firmware booting from siteboot: QEMU VMs (SeaBIOS + iPXE ROM, and OVMF's own PXE client)
//! PXE-boot the test kernel + busybox initramfs, which calls back to siteboot; checked on the
//! console, in siteboot's timeline for the MAC and in its metrics. Once with siteboot as the full
//! DHCP server, once as proxyDHCP beside dnsmasq (the site's DHCP server, addresses only).
//! Each boot finds the kernel missing at first, and boots on the boot script's next try.
//!
//! Failures panic (`unwrap`) rather than return `Err`, so they happen while the VM, siteboot and
//! dnsmasq are still alive and their consoles and logs get printed.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use serde_json::json;
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::clients::Dnsmasq;
use siteboot_tests::initramfs;
use siteboot_tests::netns::{self, Netns};
use siteboot_tests::process::Supervised;
use siteboot_tests::vm::{Firmware, Vm, VmConfig};

/// From QEMU start to the callback: ~30 s under TCG for either firmware here; generous for CI.
const BOOT_TIMEOUT: Duration = Duration::from_secs(240);
/// The site's own DHCP server in the proxyDHCP tests.
const SITE_DHCP: &str = "10.99.0.2";
/// `quiet`: the console tail printed on failure shows firmware and init, not kernel chatter.
const CMDLINE: &str = appliance::LAB_CMDLINE;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Dhcp {
    /// siteboot gives addresses and boot information.
    Full,
    /// dnsmasq gives addresses; siteboot only boot information.
    Proxy,
}

#[test]
fn bios_vm_boots_with_full_dhcp() {
    boot_from_siteboot(Firmware::Bios, Dhcp::Full, "52:54:00:00:00:11");
}

#[test]
fn uefi_vm_boots_with_full_dhcp() {
    boot_from_siteboot(Firmware::Uefi, Dhcp::Full, "52:54:00:00:00:12");
}

#[test]
fn bios_vm_boots_with_proxy_dhcp() {
    boot_from_siteboot(Firmware::Bios, Dhcp::Proxy, "52:54:00:00:00:13");
}

#[test]
fn uefi_vm_boots_with_proxy_dhcp() {
    boot_from_siteboot(Firmware::Uefi, Dhcp::Proxy, "52:54:00:00:00:14");
}

fn boot_from_siteboot(firmware: Firmware, dhcp: Dhcp, mac: &str) {
    let boot = initramfs::boot_files().unwrap();
    let ns = appliance::lab_network("boot").unwrap();
    let site = (dhcp == Dhcp::Proxy).then(|| site_dhcp(&ns));
    let mode = if dhcp == Dhcp::Full { "full" } else { "proxy" };
    let mut config = appliance::lab_config(mode);
    config["profiles"][appliance::LAB_PROFILE]["cmdline"] = json!(CMDLINE);
    let siteboot = Appliance::start(&ns, config).unwrap();
    siteboot.install_boot_files(&boot).unwrap();
    // The kernel is not there when the host first asks for it (an appliance restarting, a
    // file being replaced): the boot script tries again, and the host boots once it is back.
    let kernel = siteboot.http_root().join("lab/vmlinuz");
    let aside = kernel.with_extension("later");
    std::fs::rename(&kernel, &aside).unwrap();
    let before = siteboot.metrics().unwrap();

    let tap = ns.add_tap(appliance::BRIDGE).unwrap();
    let name = format!("{firmware:?}-{mode}");
    let mut vm = Vm::start(&ns, VmConfig::new(&name, firmware, mac, &tap)).unwrap();
    siteboot_tests::wait::until(
        "the kernel's 404",
        BOOT_TIMEOUT,
        Duration::from_millis(200),
        || {
            let timeline = siteboot.timeline(mac).ok()?;
            appliance::events(&timeline)
                .iter()
                .any(|e| e["detail"].as_str().is_some_and(|d| d.starts_with("lab/vmlinuz 404")))
                .then_some(())
        },
    )
    .unwrap();
    std::fs::rename(&aside, &kernel).unwrap();
    let marker = vm.wait_for_console("SITEBOOT-TEST: callback", BOOT_TIMEOUT).unwrap();
    assert_eq!(marker, "SITEBOOT-TEST: callback ok", "{}", why_refused(&ns, &siteboot));

    // Linux's own DHCP: from siteboot in full mode, from the site's server in proxy mode.
    let lease = vm.wait_for_console("SITEBOOT-TEST: lease", Duration::from_secs(1)).unwrap();
    let server = if dhcp == Dhcp::Full { appliance::ADDRESS } else { SITE_DHCP };
    assert!(lease.contains(&format!(" from {server} ")), "{lease}");
    if let Some((dnsmasq, _)) = &site {
        let leases = dnsmasq.leases();
        assert!(leases.contains(mac), "dnsmasq has no lease for {mac}:\n{leases}");
    }

    let timeline = siteboot.timeline(mac).unwrap();
    let stages = appliance::stages(&timeline);
    // Each entry: stages of which at least one must be in the timeline. In proxy mode the
    // address is the site server's; siteboot answers with a proxy offer (which iPXE uses as
    // is) or a proxy ACK on port 4011 (which EDK2 asks for).
    let mut expected = vec![
        if dhcp == Dhcp::Full { vec!["dhcp-ack"] } else { vec!["proxy-offer", "proxy-ack"] },
        vec!["ipxe-script"],
        vec!["http-file"],
        vec!["report"],
    ];
    // QEMU's iPXE ROM asks DHCP as iPXE and goes straight to the HTTP script; OVMF's PXE client
    // fetches iPXE over TFTP first.
    if firmware == Firmware::Uefi {
        expected.extend([vec!["tftp-start"], vec!["tftp-done"]]);
    }
    for any_of in &expected {
        assert!(
            stages.iter().any(|s| any_of.contains(&s.as_str())),
            "none of {any_of:?} in the timeline: {timeline:#}"
        );
    }
    if dhcp == Dhcp::Proxy {
        let granted = stages.iter().find(|s| *s == "dhcp-offer" || *s == "dhcp-ack");
        assert!(granted.is_none(), "siteboot offered an address in proxy mode: {timeline:#}");
    }
    let reported = appliance::events(&timeline)
        .iter()
        .any(|e| e["stage"] == "report" && e["detail"].as_str().unwrap_or("").contains("running"));
    assert!(reported, "no report of stage running in the timeline: {timeline:#}");

    // The counters saw the same boot: every expected stage counted, the kernel + initrd went
    // out over HTTP, and (UEFI) iPXE over TFTP.
    let after = siteboot.metrics().unwrap();
    for any_of in &expected {
        let moved = any_of.iter().any(|stage| {
            let series = format!("siteboot_boot_steps_total{{stage=\"{stage}\"}}");
            after.get(&series) > before.get(&series)
        });
        assert!(moved, "no boot step counter of {any_of:?} moved:\n{before:?}\n{after:?}");
    }
    let moved = |series: &str| after.get(series) - before.get(series);
    let size = |path: &std::path::Path| std::fs::metadata(path).unwrap().len() as f64;
    let boot_bytes = size(&boot.kernel) + size(&boot.initrd);
    assert!(
        moved("siteboot_http_bytes_total") >= boot_bytes,
        "siteboot_http_bytes_total moved by less than the kernel + initrd ({boot_bytes} bytes)"
    );
    if firmware == Firmware::Uefi {
        let ipxe = size("/usr/lib/ipxe/snponly.efi".as_ref());
        assert!(
            moved("siteboot_tftp_bytes_total") >= ipxe,
            "siteboot_tftp_bytes_total moved by less than snponly.efi ({ipxe} bytes)"
        );
    }
    vm.wait_exit(Duration::from_secs(30)).expect("the VM powers off after the callback");
}

/// What says why a report was refused, without the log's DEBUG lines (the harness's timeline
/// polls flood them): siteboot's other lines, its neighbour table, and the leases.
fn why_refused(ns: &Netns, siteboot: &Appliance) -> String {
    let log = siteboot.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.contains(" DEBUG ")).collect();
    let neighbours = netns::output(ns.command("ip").args(["neigh", "show"]));
    let leases = std::fs::read_to_string(siteboot.state_dir().join("leases.log"));
    let lines = lines.join("\n");
    format!("siteboot's log but DEBUG:\n{lines}\nneighbours: {neighbours:?}\nleases: {leases:?}")
}

/// The site's existing DHCP server: dnsmasq in its own namespace joined to the bridge, handing
/// out addresses only (no boot options).
fn site_dhcp(ns: &Netns) -> (Dnsmasq, Netns) {
    let site = Netns::new("site").unwrap();
    ns.connect(appliance::BRIDGE, &site, "eth0", None).unwrap();
    site.ip(&["addr", "add", &format!("{SITE_DHCP}/24"), "dev", "eth0"]).unwrap();
    let dnsmasq = Dnsmasq::start(
        &site,
        "eth0",
        &[
            "--dhcp-range=10.99.0.100,10.99.0.199,255.255.255.0,1h".into(),
            format!("--dhcp-option=option:router,{}", appliance::ADDRESS),
            "--dhcp-authoritative".into(),
        ],
    )
    .unwrap();
    (dnsmasq, site)
}

/// Checks the harness itself, with no siteboot: dnsmasq serves DHCP + TFTP, iPXE fetches the
/// kernel and initramfs over TFTP, and the ramdisk's callback reaches a netcat listener. If this
/// fails, the lab is broken, not siteboot.
#[test]
fn lab_reference_bios_vm_boots_from_dnsmasq() {
    reference_boot(Firmware::Bios, "52:54:00:00:01:01");
}

/// As above with OVMF: EDK2's PXE client gets snponly.efi over TFTP, then iPXE takes over.
#[test]
fn lab_reference_uefi_vm_boots_from_dnsmasq() {
    reference_boot(Firmware::Uefi, "52:54:00:00:01:02");
}

fn reference_boot(firmware: Firmware, mac: &str) {
    let boot = initramfs::boot_files().unwrap();
    let ns = appliance::lab_network("ref").unwrap();
    let tftp = tempfile::tempdir().unwrap();
    let copy =
        |from: &std::path::Path, to: &str| std::fs::copy(from, tftp.path().join(to)).unwrap();
    copy("/usr/lib/ipxe/undionly.kpxe".as_ref(), "undionly.kpxe");
    copy("/usr/lib/ipxe/snponly.efi".as_ref(), "snponly.efi");
    copy(&boot.kernel, "vmlinuz");
    copy(&boot.initrd, "initrd.img");
    let a = appliance::ADDRESS;
    let script = format!(
        "#!ipxe\n\
         kernel tftp://{a}/vmlinuz initrd=initrd.img {CMDLINE} siteboot.url=http://{a}:8080 siteboot.mac=${{net0/mac:hexhyp}}\n\
         initrd tftp://{a}/initrd.img\n\
         boot\n"
    );
    std::fs::write(tftp.path().join("boot.ipxe"), script).unwrap();
    let _dnsmasq = Dnsmasq::start(
        &ns,
        appliance::BRIDGE,
        &[
            "--dhcp-range=10.99.0.100,10.99.0.199,255.255.255.0,1h".into(),
            "--enable-tftp".into(),
            format!("--tftp-root={}", tftp.path().display()),
            "--dhcp-userclass=set:ipxe,iPXE".into(),
            "--dhcp-match=set:efi64,option:client-arch,7".into(),
            "--dhcp-boot=tag:ipxe,boot.ipxe".into(),
            "--dhcp-boot=tag:!ipxe,tag:efi64,snponly.efi".into(),
            "--dhcp-boot=tag:!ipxe,tag:!efi64,undionly.kpxe".into(),
        ],
    )
    .unwrap();
    // A one-request-at-a-time HTTP server: logs the request line, answers 200.
    let reply = tftp.path().join("reply.sh");
    std::fs::write(
        &reply,
        "#!/bin/sh\nread -r line\necho \"request: $line\" >&2\nprintf 'HTTP/1.0 200 OK\\r\\nContent-Length: 3\\r\\n\\r\\nok\\n'\n",
    )
    .unwrap();
    std::fs::set_permissions(&reply, std::fs::Permissions::from_mode(0o755)).unwrap();
    let callback = Supervised::spawn(
        "callback",
        ns.command("busybox").args(["nc", "-ll", "-p", "8080", "-e"]).arg(&reply),
        tftp.path(),
    )
    .unwrap();

    let tap = ns.add_tap(appliance::BRIDGE).unwrap();
    let mut vm = Vm::start(&ns, VmConfig::new("reference", firmware, mac, &tap)).unwrap();
    let marker = vm.wait_for_console("SITEBOOT-TEST: callback", BOOT_TIMEOUT).unwrap();
    assert_eq!(marker, "SITEBOOT-TEST: callback ok");
    let log = callback.log();
    let request = format!("request: POST /report/{}/running HTTP/1.1", appliance::mac_dashed(mac));
    assert!(log.contains(&request), "callback server log:\n{log}");
    vm.wait_exit(Duration::from_secs(30)).expect("the VM powers off after the callback");
}
