//! The default flavor's control-plane endpoint: keepalived (VRRP) holds the address on one
//! control-plane host (controller/src/manifests/control-plane-kubeadm-config.yaml). Two hosts,
//! each a network namespace on one segment, run the flavor's own files as the bootstrap data
//! writes them: its `configure-endpoint` finds the endpoint in kubeadm's config (init on the
//! first host, join on the second) and completes keepalived's configuration and check, then
//! Debian's keepalived runs it. The check asks the host's apiserver, here `openssl s_server`
//! with a certificate of the cluster's CA, answering `/readyz`, or nothing.
//!
//! A rollout's joining host has the higher address. While its apiserver does not answer yet,
//! and the bootstrapped host's does not either (a loaded machine), the endpoint must stay on
//! the bootstrapped host: on equal priorities VRRP prefers the higher address, and the joining
//! host took the endpoint, where no apiserver answered (the seventh rollout attempt in
//! docs/testing.md). Once the joining host's apiserver answers, it may hold the endpoint while
//! the other's does not; once both answer, the bootstrapped host holds it again.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use siteboot_tests::netns::Netns;
use siteboot_tests::process::Supervised;
use siteboot_tests::wait;

const MANIFEST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../controller/src/manifests/control-plane-kubeadm-config.yaml"
);
const ENDPOINT: &str = "10.97.0.50";
const PORT: u16 = 6443;
/// What Cluster API's bootstrap contract has the data write once it succeeded.
const SENTINEL: &str = "bootstrap-success.complete";
/// Far longer than keepalived's checks take to fail (`fall` times `interval`) and VRRP to
/// elect (three adverts of a second).
const SETTLE: Duration = Duration::from_secs(60);

/// One control-plane host: a namespace with `eth0` on the segment, and the files the bootstrap
/// data writes, seen by keepalived at their own paths (an overlay on `/etc`, a tmpfs on
/// `/run` with the test's folders bound into it).
struct Host {
    // Dropped in this order: the processes stopped, then their namespace deleted.
    keepalived: Supervised,
    apiserver: Option<Supervised>,
    name: &'static str,
    ns: Netns,
    dir: PathBuf,
}

impl Host {
    /// Starts the host's keepalived the way the flavor does; `kubeadm` is kubeadm's config
    /// file under /run/kubeadm (`(file name, text)`), `bootstrapped` whether the sentinel is
    /// there.
    fn start(
        segment: &Netns,
        (name, address): (&'static str, &str),
        kubeadm: (&str, &str),
        bootstrapped: bool,
        ca_pem: &str,
        root: &Path,
    ) -> Result<Self> {
        let ns = Netns::new(name)?;
        segment.connect("br0", &ns, "eth0", None)?;
        ns.ip(&["addr", "add", &format!("{address}/24"), "dev", "eth0"])?;
        let dir = root.join(name);
        for folder in ["upper/kubernetes/pki", "work", "kubeadm", "cluster-api", "bin", "www"] {
            std::fs::create_dir_all(dir.join(folder))?;
        }
        write_flavor_files(&dir.join("upper"))?;
        std::fs::write(dir.join("upper/kubernetes/pki/ca.crt"), ca_pem)?;
        std::fs::write(dir.join("kubeadm").join(kubeadm.0), kubeadm.1)?;
        if bootstrapped {
            std::fs::write(dir.join("cluster-api").join(SENTINEL), "")?;
        }
        // configure-endpoint ends with `systemctl enable --now keepalived`; the namespace has no
        // systemd of its own, and the machine's must not start one: the stub records the call.
        let stub = dir.join("bin/systemctl");
        std::fs::write(&stub, format!("#!/bin/sh\necho \"$*\" >> {}.called\n", stub.display()))?;
        chmod(&stub, 0o755)?;
        let d = dir.display();
        let script = format!(
            "set -e
mount -t overlay overlay -o lowerdir=/etc,upperdir={d}/upper,workdir={d}/work /etc
mount -t tmpfs tmpfs /run
mkdir -p /run/kubeadm /run/cluster-api
mount --bind {d}/kubeadm /run/kubeadm
mount --bind {d}/cluster-api /run/cluster-api
PATH={d}/bin:$PATH /etc/keepalived/configure-endpoint
exec keepalived --dont-fork --log-console --log-detail --use-file /etc/keepalived/keepalived.conf"
        );
        // `ip netns exec` gives the command a mount namespace of its own.
        let mut command = ns.command("sh");
        command.args(["-c", &script]);
        let keepalived = Supervised::spawn(&format!("keepalived-{name}"), &mut command, &dir)?;
        Ok(Self { keepalived, apiserver: None, name, ns, dir })
    }

    /// Serves `/readyz` on the host's 127.0.0.1:[`PORT`] with the certificate and key (PEM), as
    /// its apiserver.
    fn apiserver_answers(&mut self, (cert_pem, key_pem): (&str, &str)) -> Result<()> {
        let www = self.dir.join("www");
        std::fs::write(www.join("readyz"), "ok")?;
        std::fs::write(self.dir.join("apiserver.crt"), cert_pem)?;
        std::fs::write(self.dir.join("apiserver.key"), key_pem)?;
        let mut command = self.ns.command("openssl");
        command
            .args(["s_server", "-quiet", "-WWW", "-accept", &format!("127.0.0.1:{PORT}")])
            .arg("-cert")
            .arg(self.dir.join("apiserver.crt"))
            .arg("-key")
            .arg(self.dir.join("apiserver.key"))
            .current_dir(&www);
        let name = format!("apiserver-{}", self.name);
        self.apiserver = Some(Supervised::spawn(&name, &mut command, &self.dir)?);
        Ok(())
    }

    /// Whether the endpoint is on its `eth0`.
    fn holds_endpoint(&self) -> bool {
        let mut ip = Command::new("ip");
        ip.args(["-n", self.ns.name(), "-o", "-4", "addr", "show", "dev", "eth0"]);
        ip.output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(&format!(" {ENDPOINT}/32 ")))
    }

    /// The VRRP priority keepalived last logged, after its checks.
    fn effective_priority(&self) -> Option<u32> {
        let log = self.keepalived.log();
        let line = log.lines().rev().find(|l| l.contains("Changing effective priority"))?;
        line.rsplit(' ').next()?.parse().ok()
    }

    /// Stops its VRRP process, as a loaded machine's keepalived misses its adverts, until
    /// `other` took the endpoint over (VRRP's master-down timer), then lets it go on.
    fn frozen_until_taken_over(&self, other: &Host) -> Result<()> {
        let log = self.keepalived.log();
        let pid = log.lines().find_map(|l| l.split_once("Starting VRRP child process, pid="));
        let pid: i32 = pid.context("keepalived logged no VRRP process")?.1.trim().parse()?;
        // SAFETY: signals to a process of this test's own.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let what =
            format!("{} to take the endpoint while {}'s VRRP is stopped", other.name, self.name);
        let taken = wait::for_(&what, SETTLE, || other.holds_endpoint().then_some(()));
        unsafe { libc::kill(pid, libc::SIGCONT) };
        taken
    }

    fn print_logs(&self) {
        self.keepalived.print_log();
        if let Some(apiserver) = &self.apiserver {
            apiserver.print_log();
        }
    }
}

/// Writes the flavor's files under /etc (keepalived's configuration and check templates, and
/// configure-endpoint) below `upper`, with their modes.
fn write_flavor_files(upper: &Path) -> Result<()> {
    let manifest = std::fs::read_to_string(MANIFEST).with_context(|| MANIFEST.to_owned())?;
    let spec: Value = serde_norway::from_str(&manifest)?;
    let files = spec["files"].as_array().context("the kubeadmConfigSpec has no files")?;
    let mut written = 0;
    for file in files {
        let path = file["path"].as_str().context("a file without a path")?;
        let Some(relative) = path.strip_prefix("/etc/keepalived/") else { continue };
        let target = upper.join("keepalived").join(relative);
        std::fs::create_dir_all(target.parent().context("no parent")?)?;
        std::fs::write(&target, file["content"].as_str().context("a file without content")?)?;
        let mode = file["permissions"].as_str().unwrap_or("0644");
        chmod(&target, u32::from_str_radix(mode, 8)?)?;
        written += 1;
    }
    if written == 0 {
        bail!("{MANIFEST} writes nothing under /etc/keepalived");
    }
    Ok(())
}

fn chmod(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    Ok(std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?)
}

/// Waits until `holder` alone holds the endpoint, both hosts' keepalived settled at
/// `priorities` (the first host's, the joining host's).
fn settles(hosts: &[Host; 2], holder: usize, priorities: [u32; 2], what: &str) -> Result<()> {
    wait::until(what, SETTLE, Duration::from_millis(500), || {
        let settled = hosts.iter().zip(priorities).all(|(h, p)| h.effective_priority() == Some(p));
        let held = hosts.iter().enumerate().all(|(i, h)| h.holds_endpoint() == (i == holder));
        (settled && held).then_some(())
    })
    .map_err(|e| {
        let held: Vec<_> = hosts.iter().filter(|h| h.holds_endpoint()).map(|h| h.name).collect();
        let found: Vec<_> = hosts.iter().map(Host::effective_priority).collect();
        e.context(format!("held by {held:?}, priorities {found:?}"))
    })
}

/// kubeadm's config on a host, as the bootstrap data writes it under /run/kubeadm: `kubeadm
/// init`'s ClusterConfiguration, or a `kubeadm join --control-plane`'s JoinConfiguration.
fn kubeadm_config(init: bool) -> (&'static str, String) {
    let head = "apiVersion: kubeadm.k8s.io/v1beta4";
    if init {
        let config = format!(
            "{head}\nkind: ClusterConfiguration\ncontrolPlaneEndpoint: {ENDPOINT}:{PORT}\n"
        );
        ("kubeadm.yaml", config)
    } else {
        let discovery =
            format!("apiServerEndpoint: {ENDPOINT}:{PORT}\n    token: abcdef.0123456789abcdef");
        let config = format!(
            "{head}\nkind: JoinConfiguration\ndiscovery:\n  bootstrapToken:\n    {discovery}\n"
        );
        ("kubeadm-join-config.yaml", config)
    }
}

#[test]
fn the_endpoint_stays_with_a_bootstrapped_host_until_a_joining_one_answers() {
    let root = tempfile::tempdir().unwrap();
    let segment = Netns::new("vrrp").unwrap();
    segment.add_bridge("br0", "10.97.0.254/24").unwrap();
    // The cluster's CA: the apiservers' certificate is its own (self-signed), as good for curl.
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["kubernetes".to_owned()]).unwrap();
    let cert = cert.self_signed(&key).unwrap();
    let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
    // The joining host has the higher address: VRRP's tie-breaker favours it.
    let start = |host, init| {
        let (file, text) = kubeadm_config(init);
        Host::start(&segment, host, (file, &text), init, &cert_pem, root.path()).unwrap()
    };
    let mut hosts = [start(("first", "10.97.0.11"), true), start(("joining", "10.97.0.12"), false)];

    let steps = (|| -> Result<()> {
        for host in &hosts {
            let called = wait::for_("configure-endpoint to start keepalived", SETTLE, || {
                std::fs::read_to_string(host.dir.join("bin/systemctl.called")).ok()
            })?;
            anyhow::ensure!(called == "enable --now keepalived\n", "{}: {called:?}", host.name);
        }
        // Neither apiserver answers: the first host's sentinel outweighs the higher address,
        // also once the joining host became master while the first one missed its adverts.
        settles(&hosts, 0, [90, 70], "the endpoint on the bootstrapped host")?;
        hosts[0].frozen_until_taken_over(&hosts[1])?;
        settles(&hosts, 0, [90, 70], "the endpoint back on the bootstrapped host")?;
        hosts[1].apiserver_answers((&cert_pem, &key_pem))?;
        settles(&hosts, 1, [90, 100], "the endpoint on the host whose apiserver answers")?;
        hosts[0].apiserver_answers((&cert_pem, &key_pem))?;
        settles(&hosts, 0, [120, 100], "the endpoint on the bootstrapped host, both answering")
    })();
    if let Err(e) = steps {
        hosts.iter().for_each(Host::print_logs);
        panic!("{e:#}");
    }
}
