//! The bootstrap data: a cloud-init jinja template (`## template: jinja`, then `#cloud-config`)
//! that joins the host to its cluster as a plain kubelet with TLS bootstrapping, and leaves
//! nothing of siteboot running. The kubelet and containerd run on the host, or (`spec.nspawn`)
//! in a systemd-nspawn container that runs the host's own `/usr` and `/etc`: the same document,
//! with the container's two units added and another start in the join script ([`Placement`]).
//!
//! The only jinja in the document is ours (`{{ ds.meta_data.provider_id }}`, the instance's
//! provider id, which the join script checks and adds to the kubelet's configuration; without
//! one the Node registers without it, for the infrastructure provider to set): everything a user
//! or the workload cluster supplies is either base64 (file contents, the join script with the
//! user's commands, the kubeconfig) or checked against a syntax without braces (label and taint
//! words, paths, owners, modes). The YAML is built by serde_norway, never by string pasting, and
//! each user command runs in its own `sh -c` with its text single-quoted, so no input can leave
//! its place in the YAML, the template or the script.

use std::fmt;
use std::net::IpAddr;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};

use crate::crd::capi::ClusterNetwork;
use crate::crd::{BootstrapFile, NodeTaint, SitebootConfigSpec, TaintEffect};

/// The sentinel Cluster API's convention names: written last, only after a successful join.
pub const SENTINEL: &str = "/run/cluster-api/bootstrap-success.complete";
/// The bootstrap kubeconfig (holds the token); removed once the kubelet has its certificate.
pub const BOOTSTRAP_KUBECONFIG: &str = "/etc/kubernetes/bootstrap-kubelet.conf";
pub const CA_PATH: &str = "/etc/kubernetes/pki/ca.crt";
/// The join script, run by `runcmd`.
pub const JOIN_SCRIPT: &str = "/run/siteboot/join.sh";
/// How long the join waits for the kubelet's client certificate.
pub const CERTIFICATE_WAIT_SECONDS: u32 = 300;
/// The taint every new Node carries until Cluster API has matched it to its Machine.
pub const UNINITIALIZED_TAINT: &str = "node.cluster.x-k8s.io/uninitialized";

/// cloud-init's jinja renders this from the instance meta-data (NoCloud `provider-id`).
const PROVIDER_ID_JINJA: &str = "{{ ds.meta_data.provider_id }}";
/// The provider id as cloud-init rendered it, checked by the join script before use.
const PROVIDER_ID_FILE: &str = "/run/siteboot/provider-id";
/// The KubeletConfiguration without its provider id, copied into place once the id passed.
const KUBELET_CONFIG_RENDERED: &str = "/run/siteboot/kubelet-config.yaml";
const KUBELET_CONFIG: &str = "/var/lib/kubelet/config.yaml";
const KUBELET_KUBECONFIG: &str = "/etc/kubernetes/kubelet.conf";
const KUBELET_CLIENT_CERT: &str = "/var/lib/kubelet/pki/kubelet-client-current.pem";

/// The host unit that runs the nspawn mode's container; it survives reboots (enabled).
const CONTAINER_UNIT: &str = "kubelet-container.service";
/// What the container boots instead of its default target: containerd and the kubelet only, so
/// cloud-init (and with it the join script), gettys and network managers never run in it.
const CONTAINER_TARGET: &str = "kubelet-only.target";

/// Where the kubelet and containerd run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    Host,
    /// In [`CONTAINER_UNIT`]'s systemd-nspawn container, on the host's network.
    Nspawn,
}

impl Placement {
    fn of(spec: &SitebootConfigSpec) -> Self {
        if spec.nspawn == Some(true) { Self::Nspawn } else { Self::Host }
    }

    /// The join script's lines that start containerd and the kubelet (after `daemon-reload`).
    fn start_commands(self) -> String {
        match self {
            Self::Host => format!(
                r#"{HOST_KERNEL_SETTINGS}systemctl enable containerd kubelet || fail "cannot enable containerd and the kubelet"
systemctl restart containerd || fail "containerd did not start"
systemctl restart kubelet || fail "the kubelet did not start"
"#
            ),
            // The container's unit sets the host's modules and sysctls at each start. One
            // containerd per state directory: the host's own stops for good.
            Self::Nspawn => format!(
                r#"systemctl disable --now containerd || fail "cannot stop the host's own containerd"
systemctl enable {CONTAINER_UNIT} || fail "cannot enable {CONTAINER_UNIT}"
systemctl restart {CONTAINER_UNIT} || fail "the kubelet's container did not start"
"#
            ),
        }
    }
}

/// What the kubelet on the host needs of the kernel and does not set itself.
const HOST_KERNEL_SETTINGS: &str = r#"modprobe overlay 2>/dev/null || true
modprobe br_netfilter 2>/dev/null || true
sysctl -qw net.ipv4.ip_forward=1 || fail "cannot enable IPv4 forwarding"
sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
"#;

/// The data replaces containerd's config, whose default CNI plugin folder is /opt/cni/bin (and
/// the cluster's CNI installs its plugins there); Debian installs the plugins in /usr/lib/cni.
const CNI_BIN_LINK: &str = r#"if [ ! -e /opt/cni/bin ] && [ ! -L /opt/cni/bin ] && [ -d /usr/lib/cni ]; then
    mkdir -p /opt/cni
    ln -s /usr/lib/cni /opt/cni/bin
fi
"#;

/// The join script's lines that append the checked provider id, if there is one, to the
/// kubelet's configuration (a YAML mapping: one more key at its end). The id's characters
/// exclude the quote.
fn provider_id_append() -> String {
    format!(
        r#"if [ -n "$provider_id" ]; then
    echo "providerID: '$provider_id'" >> {KUBELET_CONFIG}
fi
"#
    )
}

/// Where and how the host joins: the workload cluster's API server, its CA, the token, and the
/// cluster DNS the kubelet gives pods.
pub struct JoinData<'a> {
    pub server: &'a str,
    pub ca_pem: &'a str,
    pub token_id: &'a str,
    pub token_secret: &'a str,
    pub dns: &'a ClusterDns,
}

/// kubeadm's Service range when the Cluster names none.
const DEFAULT_SERVICE_RANGE: &str = "10.96.0.0/12";
/// kubeadm's DNS domain when the Cluster names none.
const DEFAULT_DNS_DOMAIN: &str = "cluster.local";
/// kubeadm gives the cluster DNS Service this address of the Service range.
const DNS_SERVICE_INDEX: u128 = 10;

/// The kubelet's `clusterDNS` and `clusterDomain`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterDns {
    pub servers: Vec<IpAddr>,
    pub domain: String,
}

impl ClusterDns {
    /// The config's own settings, else what kubeadm derives from the Cluster's network (the
    /// tenth address of its first Service range; its Service domain), else kubeadm's defaults.
    pub fn resolve(
        spec: &SitebootConfigSpec,
        network: Option<&ClusterNetwork>,
    ) -> Result<Self, SpecError> {
        let servers = if spec.cluster_dns.is_empty() {
            let range = network
                .and_then(|n| n.services.as_ref())
                .and_then(|s| s.cidr_blocks.first())
                .map_or(DEFAULT_SERVICE_RANGE, String::as_str);
            let server = indexed_address(range, DNS_SERVICE_INDEX)
                .ok_or_else(|| SpecError::ServiceRange(range.to_owned()))?;
            vec![server]
        } else {
            cluster_dns_servers(spec)?
        };
        let checked = |domain: &String, error: fn(String) -> SpecError| {
            if is_dns_subdomain(domain) { Ok(domain.clone()) } else { Err(error(domain.clone())) }
        };
        let domain = match (&spec.cluster_domain, network.and_then(|n| n.service_domain.as_ref())) {
            (Some(domain), _) => checked(domain, SpecError::ClusterDomain)?,
            (None, Some(domain)) => checked(domain, SpecError::ServiceDomain)?,
            (None, None) => DEFAULT_DNS_DOMAIN.to_owned(),
        };
        Ok(Self { servers, domain })
    }
}

fn cluster_dns_servers(spec: &SitebootConfigSpec) -> Result<Vec<IpAddr>, SpecError> {
    spec.cluster_dns
        .iter()
        .enumerate()
        .map(|(index, s)| s.parse().map_err(|_| SpecError::ClusterDns { index, value: s.clone() }))
        .collect()
}

/// The `index`th address of a CIDR range (counting its network address as 0), as kubeadm's
/// `GetIndexedIP`; None when the text is not a CIDR or the range is too small.
fn indexed_address(cidr: &str, index: u128) -> Option<IpAddr> {
    let (address, prefix) = cidr.split_once('/')?;
    let address: IpAddr = address.parse().ok()?;
    let prefix: u32 = prefix.parse().ok()?;
    let bits: u32 = if address.is_ipv4() { 32 } else { 128 };
    let host_bits = bits.checked_sub(prefix)?;
    if host_bits < 128 && index >= 1u128 << host_bits {
        return None;
    }
    Some(match address {
        IpAddr::V4(a) => {
            let network = u32::from(a) & u32::MAX.checked_shl(host_bits).unwrap_or(0);
            IpAddr::V4((network + index as u32).into())
        }
        IpAddr::V6(a) => {
            let network = u128::from(a) & u128::MAX.checked_shl(host_bits).unwrap_or(0);
            IpAddr::V6((network + index).into())
        }
    })
}

/// What the renderer refuses, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("nodeLabels key {0:?} is not a Kubernetes label key")]
    LabelKey(String),
    #[error("nodeLabels[{key:?}] value {value:?} is not a Kubernetes label value")]
    LabelValue { key: String, value: String },
    #[error("nodeTaints key {0:?} is not a Kubernetes label key")]
    TaintKey(String),
    #[error("nodeTaints[{key:?}] value {value:?} is not a Kubernetes label value")]
    TaintValue { key: String, value: String },
    #[error("files path {0:?} must be absolute, without braces or control characters")]
    Path(String),
    #[error("files[{path:?}] permissions {permissions:?} are not an octal mode like 0644")]
    Permissions { path: String, permissions: String },
    #[error("files[{path:?}] owner {owner:?} is not user or user:group")]
    Owner { path: String, owner: String },
    #[error("{field}[{index}] contains a NUL byte")]
    NulInCommand { field: &'static str, index: usize },
    #[error("clusterDNS[{index}] {value:?} is not an IP address")]
    ClusterDns { index: usize, value: String },
    #[error("clusterDomain {0:?} is not a DNS domain")]
    ClusterDomain(String),
    #[error(
        "the Cluster's spec.clusterNetwork.services.cidrBlocks[0] {0:?} is not a CIDR range with a tenth address for the cluster DNS: set clusterDNS"
    )]
    ServiceRange(String),
    #[error(
        "the Cluster's spec.clusterNetwork.serviceDomain {0:?} is not a DNS domain: set clusterDomain"
    )]
    ServiceDomain(String),
}

/// The rendered document. Holds the token: its Debug never shows the text.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapData(pub String);

impl fmt::Debug for BootstrapData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BootstrapData({} bytes)", self.0.len())
    }
}

/// Checks everything [`render`] would refuse, so a config is refused before a token is made.
pub fn validate(spec: &SitebootConfigSpec) -> Result<(), SpecError> {
    for (key, value) in &spec.node_labels {
        if !is_label_key(key) {
            return Err(SpecError::LabelKey(key.clone()));
        }
        if !is_label_value(value) {
            return Err(SpecError::LabelValue { key: key.clone(), value: value.clone() });
        }
    }
    for taint in &spec.node_taints {
        if !is_label_key(&taint.key) {
            return Err(SpecError::TaintKey(taint.key.clone()));
        }
        if let Some(value) = &taint.value
            && !is_label_value(value)
        {
            return Err(SpecError::TaintValue { key: taint.key.clone(), value: value.clone() });
        }
    }
    for file in &spec.files {
        check_file(file)?;
    }
    for (field, commands) in
        [("preCommands", &spec.pre_commands), ("postCommands", &spec.post_commands)]
    {
        if let Some(index) = commands.iter().position(|c| c.contains('\0')) {
            return Err(SpecError::NulInCommand { field, index });
        }
    }
    cluster_dns_servers(spec)?;
    if let Some(domain) = &spec.cluster_domain
        && !is_dns_subdomain(domain)
    {
        return Err(SpecError::ClusterDomain(domain.clone()));
    }
    Ok(())
}

fn check_file(file: &BootstrapFile) -> Result<(), SpecError> {
    let path = &file.path;
    if !path.starts_with('/') || path.chars().any(|c| c.is_control() || c == '{' || c == '}') {
        return Err(SpecError::Path(path.clone()));
    }
    if let Some(p) = &file.permissions {
        let digits = p.strip_prefix('0').filter(|d| d.len() == 3).unwrap_or(p);
        if digits.len() != 3 || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
            return Err(SpecError::Permissions { path: path.clone(), permissions: p.clone() });
        }
    }
    if let Some(owner) = &file.owner {
        let name = |s: &str| {
            let mut bytes = s.bytes();
            bytes.next().is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
                && bytes
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        };
        let valid = match owner.split_once(':') {
            Some((user, group)) => name(user) && name(group),
            None => name(owner),
        };
        if !valid {
            return Err(SpecError::Owner { path: path.clone(), owner: owner.clone() });
        }
    }
    Ok(())
}

/// A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a name.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    prefix.is_none_or(is_dns_subdomain) && !name.is_empty() && is_label_value(name)
}

/// A DNS subdomain as Kubernetes names them: dot-separated lower-case labels of letters,
/// digits and inner hyphens, at most 253 characters.
fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// A Kubernetes label value: empty, or up to 63 of `[A-Za-z0-9_.-]` starting and ending
/// alphanumeric.
fn is_label_value(value: &str) -> bool {
    let alnum = |c: Option<u8>| c.is_some_and(|b| b.is_ascii_alphanumeric());
    value.is_empty()
        || (value.len() <= 63
            && alnum(value.bytes().next())
            && alnum(value.bytes().last())
            && value.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)))
}

/// `text` as one single-quoted shell word: nothing in it is interpreted by the shell.
pub fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The cloud-config for `spec`, joining through `join`.
pub fn render(spec: &SitebootConfigSpec, join: &JoinData) -> Result<BootstrapData, SpecError> {
    validate(spec)?;
    let placement = Placement::of(spec);
    let b64_file = |path: &str, permissions: &str, content: &str| {
        json!({ "path": path, "permissions": permissions, "owner": "root:root",
                "encoding": "b64", "content": BASE64.encode(content) })
    };
    let mut files = vec![
        b64_file(CA_PATH, "0644", join.ca_pem),
        b64_file(BOOTSTRAP_KUBECONFIG, "0600", &bootstrap_kubeconfig(join)),
        // Rendered by cloud-init's jinja: the only templated file.
        json!({ "path": PROVIDER_ID_FILE, "permissions": "0644", "content": format!("{PROVIDER_ID_JINJA}\n") }),
        b64_file(KUBELET_CONFIG_RENDERED, "0644", &kubelet_config(&spec.node_taints, join.dns)),
        b64_file("/etc/containerd/config.toml", "0644", CONTAINERD_CONFIG),
        b64_file("/etc/systemd/system/kubelet.service", "0644", KUBELET_UNIT),
        b64_file(
            "/etc/systemd/system/kubelet.service.d/zz-siteboot.conf",
            "0644",
            &kubelet_drop_in(spec),
        ),
    ];
    if placement == Placement::Nspawn {
        files.push(b64_file(
            &format!("/etc/systemd/system/{CONTAINER_UNIT}"),
            "0644",
            &container_unit(),
        ));
        files.push(b64_file(
            &format!("/etc/systemd/system/{CONTAINER_TARGET}"),
            "0644",
            CONTAINER_TARGET_FILE,
        ));
    }
    // After siteboot's own files, so a user's file (a containerd config, say) wins.
    files.extend(spec.files.iter().map(|f| {
        json!({ "path": f.path, "permissions": f.permissions.as_deref().unwrap_or("0644"),
                "owner": f.owner.as_deref().unwrap_or("root:root"),
                "encoding": "b64", "content": BASE64.encode(&f.content) })
    }));
    files.push(b64_file(JOIN_SCRIPT, "0700", &join_script(spec, placement)));
    let document = json!({ "write_files": files, "runcmd": [["/bin/sh", JOIN_SCRIPT]] });
    let yaml = serde_norway::to_string(&document).expect("a JSON value serializes as YAML");
    Ok(BootstrapData(format!("## template: jinja\n#cloud-config\n{yaml}")))
}

fn bootstrap_kubeconfig(join: &JoinData) -> String {
    let config = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{ "name": "workload", "cluster": { "server": join.server, "certificate-authority": CA_PATH } }],
        "users": [{ "name": "kubelet-bootstrap", "user": { "token": format!("{}.{}", join.token_id, join.token_secret) } }],
        "contexts": [{ "name": "bootstrap", "context": { "cluster": "workload", "user": "kubelet-bootstrap" } }],
        "current-context": "bootstrap",
    });
    serde_norway::to_string(&config).expect("a JSON value serializes as YAML")
}

fn kubelet_config(taints: &[NodeTaint], dns: &ClusterDns) -> String {
    let mut register = vec![json!({ "key": UNINITIALIZED_TAINT, "effect": "NoSchedule" })];
    register.extend(taints.iter().map(|t| {
        let effect = match t.effect {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        };
        let mut taint = json!({ "key": t.key, "effect": effect });
        if let Some(value) = &t.value {
            taint["value"] = Value::from(value.as_str());
        }
        taint
    }));
    let config = json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "systemd",
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "rotateCertificates": true,
        "authentication": {
            "anonymous": { "enabled": false },
            "webhook": { "enabled": true },
            "x509": { "clientCAFile": CA_PATH },
        },
        "authorization": { "mode": "Webhook" },
        "registerWithTaints": register,
        "clusterDNS": dns.servers.iter().map(IpAddr::to_string).collect::<Vec<_>>(),
        "clusterDomain": dns.domain,
    });
    serde_norway::to_string(&config).expect("a JSON value serializes as YAML")
}

/// containerd's CRI with the systemd cgroup driver, as the kubelet is configured.
const CONTAINERD_CONFIG: &str = r#"# Written by siteboot's bootstrap data: the systemd cgroup driver, as the kubelet uses.
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
"#;

/// A unit for images that have none; its ExecStart comes from the drop-in, which sorts after
/// any packaged drop-in (kubeadm's `10-kubeadm.conf`) and so replaces their ExecStart.
const KUBELET_UNIT: &str = "[Unit]
Description=kubelet (joined by siteboot bootstrap data)
Wants=network-online.target containerd.service
After=network-online.target containerd.service

[Service]
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
";

/// The nspawn mode's container: a tmpfs root with the host's `/usr` (`--directory=/
/// --volatile=yes`) and `/etc` read-only, so it runs the host's programs with exactly the files
/// cloud-init wrote. systemd 252 refuses `--directory=/` with `--volatile=overlay`, and with
/// `--volatile=state` (the host's root read-only) it cannot create `/run/host`. Bound in from the
/// host, writable, is what must outlive the container, be seen by the host or be written by the
/// cluster: the kubelet's state and certificates (the join script waits for them and removes the
/// bootstrap kubeconfig), containerd's state, the pods' logs, the CNI configuration and plugin
/// folders (a cluster's CNI installs there), and `/dev/kmsg` (the kubelet's OOM watcher). Host
/// network, every capability, no seccomp filter (runc needs what nspawn's filter refuses,
/// keyctl among them), `/proc/sys/net` writable (CNI plugins set interface sysctls); the rest of
/// `/proc/sys` stays read-only, so the unit sets the sysctls the kubelet would otherwise write
/// (its `setupKernelTunables`) on the host first. `Delegate=yes`: the container's systemd
/// manages the cgroup subtree, where the kubelet and runc use the systemd cgroup driver. The
/// container's init reads its arguments like a kernel command line: it boots only
/// [`CONTAINER_TARGET`], without the host's network managers (the host's network is up) and
/// without applying the host's fstab root options to its tmpfs root.
fn container_unit() -> String {
    format!(
        "[Unit]
Description=containerd and the kubelet in a systemd-nspawn container (siteboot bootstrap data)
Wants=network-online.target
After=network-online.target

[Service]
Type=notify
Environment=SYSTEMD_SECCOMP=0 SYSTEMD_NSPAWN_API_VFS_WRITABLE=network
ExecStartPre=-modprobe overlay
ExecStartPre=-modprobe br_netfilter
ExecStartPre=sysctl -qw net.ipv4.ip_forward=1 vm.overcommit_memory=1 vm.panic_on_oom=0 kernel.panic=10 kernel.panic_on_oops=1 kernel.keys.root_maxkeys=1000000 kernel.keys.root_maxbytes=25000000
ExecStartPre=-sysctl -qw net.bridge.bridge-nf-call-iptables=1
ExecStartPre=mkdir -p /var/lib/kubelet /etc/kubernetes /var/lib/containerd /var/log/pods /var/log/containers /etc/cni/net.d /opt/cni/bin
ExecStart=systemd-nspawn --quiet --keep-unit --register=no \\
    --directory=/ --volatile=yes --bind-ro=/etc --hostname=%H --capability=all \\
    --bind=/var/lib/kubelet --bind=/etc/kubernetes --bind=/var/lib/containerd \\
    --bind=/var/log/pods --bind=/var/log/containers --bind=/etc/cni/net.d \\
    --bind=/opt/cni/bin --bind=/dev/kmsg \\
    --boot systemd.unit={CONTAINER_TARGET} \\
    systemd.mask=network-online.target systemd.mask=systemd-networkd.service \\
    systemd.mask=systemd-networkd.socket systemd.mask=systemd-resolved.service \\
    systemd.mask=systemd-remount-fs.service
KillMode=mixed
Delegate=yes
TasksMax=infinity
Restart=always
RestartSec=5
# nspawn's exit status when the container asked to reboot.
SuccessExitStatus=133
RestartForceExitStatus=133

[Install]
WantedBy=multi-user.target
"
    )
}

/// Booted by the container instead of its default target (see [`container_unit`]).
const CONTAINER_TARGET_FILE: &str = "[Unit]
Description=containerd and the kubelet, nothing else (the kubelet container's boot target)
Requires=basic.target
After=basic.target
Wants=containerd.service kubelet.service
AllowIsolate=yes
";

fn kubelet_drop_in(spec: &SitebootConfigSpec) -> String {
    let mut exec = format!(
        "/usr/bin/kubelet --config={KUBELET_CONFIG} --bootstrap-kubeconfig={BOOTSTRAP_KUBECONFIG} --kubeconfig={KUBELET_KUBECONFIG}"
    );
    if !spec.node_labels.is_empty() {
        // Checked label syntax: no character systemd or the kubelet would read specially.
        let labels: Vec<String> =
            spec.node_labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        exec.push_str(&format!(" --node-labels={}", labels.join(",")));
    }
    format!("[Service]\nExecStart=\nExecStart={exec}\n")
}

fn join_script(spec: &SitebootConfigSpec, placement: Placement) -> String {
    let commands = |field: &str, commands: &[String]| -> String {
        commands
            .iter()
            .enumerate()
            .map(|(i, c)| {
                // The index, not the text: a command may carry a secret of its own.
                format!("/bin/sh -c {} || fail \"{field}[{i}] failed\"\n", shell_quote(c))
            })
            .collect()
    };
    format!(
        r#"#!/bin/sh
# siteboot bootstrap: joins this host to its cluster as a kubelet, then exits.
set -eu
fail() {{
    echo "siteboot bootstrap FAILED: $*" >&2
    echo "siteboot bootstrap FAILED: $*" > /dev/console 2>/dev/null || true
    exit 1
}}
provider_id=$(cat {PROVIDER_ID_FILE})
case "$provider_id" in
    ""|*CI_MISSING_JINJA_VAR*)
        provider_id=""
        echo "siteboot bootstrap: the instance meta-data has no provider-id; the Node registers without one, for the infrastructure provider to set" ;;
    *[!A-Za-z0-9._:/@-]*)
        fail "the instance meta-data's provider-id has characters a providerID cannot have" ;;
esac
{pre}install -d -m 0755 /var/lib/kubelet
cp {KUBELET_CONFIG_RENDERED} {KUBELET_CONFIG}
{append}{CNI_BIN_LINK}systemctl daemon-reload
{start}waited=0
until [ -s {KUBELET_CLIENT_CERT} ]; do
    [ "$waited" -lt {CERTIFICATE_WAIT_SECONDS} ] || fail "the kubelet got no client certificate within {CERTIFICATE_WAIT_SECONDS} s (TLS bootstrap: token valid? CSRs approved?)"
    sleep 1
    waited=$((waited + 1))
done
rm -f {BOOTSTRAP_KUBECONFIG}
{post}mkdir -p /run/cluster-api
echo success > {SENTINEL}
"#,
        pre = commands("preCommands", &spec.pre_commands),
        post = commands("postCommands", &spec.post_commands),
        start = placement.start_commands(),
        append = provider_id_append(),
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    static DNS: std::sync::LazyLock<ClusterDns> =
        std::sync::LazyLock::new(|| ClusterDns::resolve(&Default::default(), None).unwrap());

    fn join() -> JoinData<'static> {
        JoinData {
            server: "https://10.0.0.1:6443",
            ca_pem: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
            token_id: "abcdef",
            token_secret: "0123456789abcdef",
            dns: &DNS,
        }
    }

    /// The document as cloud-init would parse it after jinja, with `provider_id` substituted.
    fn parsed(data: &BootstrapData, provider_id: &str) -> Value {
        let text = data.0.replace(PROVIDER_ID_JINJA, provider_id);
        serde_norway::from_str(&text).expect("the cloud-config is YAML")
    }

    fn file<'a>(doc: &'a Value, path: &str) -> &'a Value {
        doc["write_files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == path)
            .unwrap_or_else(|| panic!("no file {path}"))
    }

    fn content(doc: &Value, path: &str) -> String {
        let f = file(doc, path);
        let raw = f["content"].as_str().unwrap();
        if f["encoding"] == "b64" {
            String::from_utf8(BASE64.decode(raw).unwrap()).unwrap()
        } else {
            raw.to_owned()
        }
    }

    /// Every `{{`/`{%`/`{#` in the text: cloud-init's jinja would evaluate each.
    fn jinja_markers(text: &str) -> Vec<&str> {
        ["{{", "{%", "{#"]
            .into_iter()
            .flat_map(|m| text.match_indices(m).map(|(i, _)| &text[i..(i + 30).min(text.len())]))
            .collect()
    }

    #[test]
    fn a_plain_config_renders_a_join_through_tls_bootstrapping() {
        let data = render(&SitebootConfigSpec::default(), &join()).unwrap();
        assert!(data.0.starts_with("## template: jinja\n#cloud-config\n"));
        assert_eq!(jinja_markers(&data.0).len(), 1, "only the provider-id placeholder");
        let doc = parsed(&data, "siteboot://metal/host-0");
        assert_eq!(content(&doc, CA_PATH), join().ca_pem);
        assert_eq!(file(&doc, BOOTSTRAP_KUBECONFIG)["permissions"], "0600");
        let kubeconfig: Value =
            serde_norway::from_str(&content(&doc, BOOTSTRAP_KUBECONFIG)).unwrap();
        assert_eq!(kubeconfig["clusters"][0]["cluster"]["server"], join().server);
        assert_eq!(kubeconfig["users"][0]["user"]["token"], "abcdef.0123456789abcdef");
        let kubelet: Value =
            serde_norway::from_str(&content(&doc, KUBELET_CONFIG_RENDERED)).unwrap();
        assert!(kubelet.get("providerID").is_none(), "the join script adds the checked id");
        assert_eq!(kubelet["cgroupDriver"], "systemd");
        assert_eq!(kubelet["clusterDNS"], json!(["10.96.0.10"]), "kubeadm's default");
        assert_eq!(kubelet["clusterDomain"], "cluster.local");
        assert_eq!(
            kubelet["registerWithTaints"],
            json!([{ "key": UNINITIALIZED_TAINT, "effect": "NoSchedule" }])
        );
        assert!(content(&doc, "/etc/containerd/config.toml").contains("SystemdCgroup = true"));
        let drop_in = content(&doc, "/etc/systemd/system/kubelet.service.d/zz-siteboot.conf");
        assert!(drop_in.contains(&format!("--bootstrap-kubeconfig={BOOTSTRAP_KUBECONFIG}")));
        assert!(!drop_in.contains("--node-labels"));
        assert_eq!(doc["runcmd"], json!([["/bin/sh", JOIN_SCRIPT]]));
        // The join script is the last file written: user files cannot replace it.
        assert_eq!(doc["write_files"].as_array().unwrap().last().unwrap()["path"], JOIN_SCRIPT);
    }

    #[test]
    fn the_join_script_checks_the_provider_id_first_and_writes_the_sentinel_last() {
        let spec = SitebootConfigSpec {
            pre_commands: vec!["echo pre".into()],
            post_commands: vec!["echo post".into()],
            ..Default::default()
        };
        let doc = parsed(&render(&spec, &join()).unwrap(), "siteboot://metal/host-0");
        let script = content(&doc, JOIN_SCRIPT);
        let at = |needle: &str| script.find(needle).unwrap_or_else(|| panic!("no {needle:?}"));
        assert!(script.starts_with("#!/bin/sh\n"));
        assert!(at("set -eu") < at("CI_MISSING_JINJA_VAR"));
        assert!(at("CI_MISSING_JINJA_VAR") < at("'echo pre'"), "the guard runs before anything");
        assert!(at("'echo pre'") < at(&format!("cp {KUBELET_CONFIG_RENDERED}")));
        assert!(at(&format!("cp {KUBELET_CONFIG_RENDERED}")) < at(&provider_id_append()));
        assert!(at(&provider_id_append()) < at("systemctl daemon-reload"));
        assert!(at("systemctl restart kubelet") < at(KUBELET_CLIENT_CERT));
        assert!(at(KUBELET_CLIENT_CERT) < at(&format!("rm -f {BOOTSTRAP_KUBECONFIG}")));
        assert!(at(&format!("rm -f {BOOTSTRAP_KUBECONFIG}")) < at("'echo post'"));
        assert!(at("'echo post'") < at(SENTINEL));
        assert!(script.contains(&format!("-lt {CERTIFICATE_WAIT_SECONDS} ]")), "bounded wait");
    }

    /// Runs the join script's provider-id guard and its append to the kubelet's configuration
    /// in a real shell against what cloud-init renders: an id is added to the configuration
    /// the kubelet reads; a missing one leaves it out, saying so; an odd one stops the join.
    #[test]
    fn the_provider_id_is_checked_then_added_to_the_kubelet_configuration() {
        let data = render(&SitebootConfigSpec::default(), &join()).unwrap();
        let doc = parsed(&data, "unused");
        let script = content(&doc, JOIN_SCRIPT);
        let guard_end = script.find("esac\n").unwrap() + "esac\n".len();
        let dir = std::env::temp_dir().join(format!("siteboot-guard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (id_file, rendered, config) =
            (dir.join("provider-id"), dir.join("rendered.yaml"), dir.join("config.yaml"));
        std::fs::write(&rendered, content(&doc, KUBELET_CONFIG_RENDERED)).unwrap();
        let run = |provider_id: &str| {
            std::fs::write(&id_file, format!("{provider_id}\n")).unwrap();
            let _ = std::fs::remove_file(&config);
            let guard = script[..guard_end]
                .replace(PROVIDER_ID_FILE, id_file.to_str().unwrap())
                .replace("> /dev/console", "> /dev/null");
            let copy = format!("cp {} {}\n", rendered.display(), config.display());
            let append = provider_id_append().replace(KUBELET_CONFIG, config.to_str().unwrap());
            let out = std::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(format!("{guard}{copy}{append}echo passed"))
                .output()
                .unwrap();
            let kubelet: Option<Value> = std::fs::read_to_string(&config)
                .ok()
                .map(|text| serde_norway::from_str(&text).expect("the configuration stays YAML"));
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                out.stderr,
                kubelet,
            )
        };
        let (ok, stdout, _, kubelet) = run("siteboot://metal/host-0");
        assert!(ok && stdout.contains("passed"));
        let kubelet = kubelet.unwrap();
        assert_eq!(kubelet["providerID"], "siteboot://metal/host-0");
        assert_eq!(kubelet["cgroupDriver"], "systemd", "the rest of the configuration kept");
        for missing in ["CI_MISSING_JINJA_VAR/provider_id", ""] {
            let (ok, stdout, _, kubelet) = run(missing);
            assert!(ok && stdout.contains("passed"), "{missing:?}");
            assert!(stdout.contains("no provider-id; the Node registers without one"), "{stdout}");
            let kubelet = kubelet.unwrap();
            assert!(kubelet.get("providerID").is_none(), "{missing:?}: {kubelet}");
            assert_eq!(kubelet["cgroupDriver"], "systemd");
        }
        for bad in ["a'b", "x y", "$(reboot)", "id\nproviderID: other"] {
            let (ok, stdout, stderr, kubelet) = run(bad);
            assert!(!ok && !stdout.contains("passed"), "{bad:?} passed the guard");
            let stderr = String::from_utf8_lossy(&stderr);
            assert!(stderr.contains("siteboot bootstrap FAILED"), "{bad:?}: {stderr}");
            assert!(kubelet.is_none(), "{bad:?}: nothing copied");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cluster_dns_comes_from_the_config_then_the_cluster_then_kubeadms_defaults() {
        let network = |range: Option<&str>, domain: Option<&str>| ClusterNetwork {
            services: range.map(|r| crate::crd::capi::NetworkRanges {
                cidr_blocks: vec![r.into(), "fd00:10:96::/108".into()],
            }),
            service_domain: domain.map(Into::into),
        };
        let spec = |dns: &[&str], domain: Option<&str>| SitebootConfigSpec {
            cluster_dns: dns.iter().map(|s| (*s).into()).collect(),
            cluster_domain: domain.map(Into::into),
            ..Default::default()
        };
        let resolved = |spec: &SitebootConfigSpec, network: Option<&ClusterNetwork>| {
            ClusterDns::resolve(spec, network)
                .map(|d| (d.servers.iter().map(ToString::to_string).collect::<Vec<_>>(), d.domain))
        };
        let ok = |servers: &[&str], domain: &str| {
            Ok((servers.iter().map(|s| (*s).to_owned()).collect(), domain.to_owned()))
        };
        let cases = [
            (spec(&[], None), None, ok(&["10.96.0.10"], "cluster.local")),
            (spec(&[], None), Some(network(None, None)), ok(&["10.96.0.10"], "cluster.local")),
            (
                spec(&[], None),
                Some(network(Some("10.128.0.0/16"), Some("k8s.example"))),
                ok(&["10.128.0.10"], "k8s.example"),
            ),
            // The range's network, whatever address the CIDR was written with.
            (
                spec(&[], None),
                Some(network(Some("10.0.5.77/24"), None)),
                ok(&["10.0.5.10"], "cluster.local"),
            ),
            (
                spec(&[], None),
                Some(network(Some("fd00::/112"), None)),
                ok(&["fd00::a"], "cluster.local"),
            ),
            (
                spec(&[], None),
                Some(network(Some("10.0.0.16/28"), None)),
                ok(&["10.0.0.26"], "cluster.local"),
            ),
            (
                spec(&["10.0.0.53", "fd00::53"], Some("corp.internal")),
                Some(network(Some("10.128.0.0/16"), Some("k8s.example"))),
                ok(&["10.0.0.53", "fd00::53"], "corp.internal"),
            ),
            (
                spec(&[], None),
                Some(network(Some("10.0.0.0/29"), None)),
                Err(SpecError::ServiceRange("10.0.0.0/29".into())),
            ),
            (
                spec(&[], None),
                Some(network(Some("10.96.0.0"), None)),
                Err(SpecError::ServiceRange("10.96.0.0".into())),
            ),
            (
                spec(&[], None),
                Some(network(Some("10.96.0.0/33"), None)),
                Err(SpecError::ServiceRange("10.96.0.0/33".into())),
            ),
            (
                spec(&[], None),
                Some(network(None, Some("Bad_Domain"))),
                Err(SpecError::ServiceDomain("Bad_Domain".into())),
            ),
            // The config's own settings win, so a bad Cluster value can be overridden.
            (
                spec(&["10.0.0.53"], Some("ok.example")),
                Some(network(Some("nonsense"), Some("Bad_Domain"))),
                ok(&["10.0.0.53"], "ok.example"),
            ),
            (
                spec(&["10.0.0.53", "dns.example"], None),
                None,
                Err(SpecError::ClusterDns { index: 1, value: "dns.example".into() }),
            ),
            (spec(&[], Some("{{ x }}")), None, Err(SpecError::ClusterDomain("{{ x }}".into()))),
        ];
        for (spec, network, expected) in cases {
            assert_eq!(resolved(&spec, network.as_ref()), expected, "{spec:?} {network:?}");
        }
        // What resolve refuses of the config alone, validate refuses before any token.
        assert!(validate(&spec(&["10.0.0.53", "dns.example"], None)).is_err());
        assert!(validate(&spec(&[], Some("a..b"))).is_err());
        assert!(validate(&spec(&["10.0.0.53"], Some("cluster.local"))).is_ok());
    }

    #[test]
    fn the_cluster_dns_reaches_the_kubelet() {
        let dns = ClusterDns {
            servers: vec!["10.0.0.53".parse().unwrap(), "fd00::53".parse().unwrap()],
            domain: "corp.internal".into(),
        };
        let join = JoinData { dns: &dns, ..join() };
        let doc = parsed(&render(&SitebootConfigSpec::default(), &join).unwrap(), "p");
        let kubelet: Value =
            serde_norway::from_str(&content(&doc, KUBELET_CONFIG_RENDERED)).unwrap();
        assert_eq!(kubelet["clusterDNS"], json!(["10.0.0.53", "fd00::53"]));
        assert_eq!(kubelet["clusterDomain"], "corp.internal");
    }

    /// The kernel settings the kubelet's `setupKernelTunables` writes unless they are set.
    const KUBELET_TUNABLES: [&str; 6] = [
        "vm.overcommit_memory=1",
        "vm.panic_on_oom=0",
        "kernel.panic=10",
        "kernel.panic_on_oops=1",
        "kernel.keys.root_maxkeys=1000000",
        "kernel.keys.root_maxbytes=25000000",
    ];

    #[test]
    fn nspawn_mode_is_the_same_document_with_the_container_and_another_start() {
        let host = parsed(&render(&SitebootConfigSpec::default(), &join()).unwrap(), "p");
        let spec = SitebootConfigSpec { nspawn: Some(true), ..Default::default() };
        let data = render(&spec, &join()).unwrap();
        assert_eq!(jinja_markers(&data.0).len(), 1, "only the provider-id placeholder");
        let doc = parsed(&data, "p");
        let paths = |doc: &Value| -> Vec<String> {
            let files = doc["write_files"].as_array().unwrap();
            files.iter().map(|f| f["path"].as_str().unwrap().to_owned()).collect()
        };
        let unit_path = format!("/etc/systemd/system/{CONTAINER_UNIT}");
        let target_path = format!("/etc/systemd/system/{CONTAINER_TARGET}");
        let mut expected = paths(&host);
        expected.splice(
            expected.len() - 1..,
            [unit_path.clone(), target_path.clone(), JOIN_SCRIPT.into()],
        );
        assert_eq!(paths(&doc), expected, "the host's files, the container's, the script last");
        for path in paths(&host).iter().filter(|p| *p != JOIN_SCRIPT) {
            assert_eq!(content(&doc, path), content(&host, path), "{path} differs");
        }

        // The join scripts differ only in how containerd and the kubelet start.
        let (host_script, script) = (content(&host, JOIN_SCRIPT), content(&doc, JOIN_SCRIPT));
        let host_start = Placement::Host.start_commands();
        let start = Placement::Nspawn.start_commands();
        assert_eq!(script.replace(&start, &host_start), host_script);
        let at = |needle: &str| script.find(needle).unwrap_or_else(|| panic!("no {needle:?}"));
        assert!(at("systemctl daemon-reload") < at("systemctl disable --now containerd"));
        assert!(at("systemctl disable --now containerd") < at(&format!("enable {CONTAINER_UNIT}")));
        assert!(at(&format!("restart {CONTAINER_UNIT}")) < at(KUBELET_CLIENT_CERT));
        assert!(at(KUBELET_CLIENT_CERT) < at(SENTINEL));
        assert!(!script.contains("restart kubelet ") && !script.contains("enable containerd"));
        assert!(!host_script.contains(CONTAINER_UNIT));

        let unit = content(&doc, &unit_path);
        let exec = unit.replace(" \\\n    ", " ");
        let exec = exec.lines().find(|l| l.starts_with("ExecStart=")).unwrap();
        for option in [
            "ExecStart=systemd-nspawn ",
            " --directory=/ --volatile=yes --bind-ro=/etc ",
            " --keep-unit --register=no ",
            " --hostname=%H ",
            " --capability=all ",
            " --bind=/var/lib/kubelet ",
            " --bind=/etc/kubernetes ",
            " --bind=/var/lib/containerd ",
            " --bind=/etc/cni/net.d ",
            " --bind=/opt/cni/bin ",
            " --bind=/dev/kmsg ",
            &format!(" --boot systemd.unit={CONTAINER_TARGET} "),
            " systemd.mask=systemd-networkd.socket ",
            " systemd.mask=network-online.target ",
        ] {
            assert!(format!("{exec} ").contains(option), "no {option:?} in {exec}");
        }
        assert!(
            !exec.contains("--private-network") && !exec.contains("--network-"),
            "host network"
        );
        for line in ["Delegate=yes", "Type=notify", "KillMode=mixed", "WantedBy=multi-user.target"]
        {
            assert!(unit.lines().any(|l| l == line), "no {line} in the unit");
        }
        let environment = unit.lines().find(|l| l.starts_with("Environment=")).unwrap();
        assert!(environment.contains("SYSTEMD_SECCOMP=0"), "{environment}");
        let sysctl = unit.lines().find(|l| l.starts_with("ExecStartPre=sysctl ")).unwrap();
        for setting in ["net.ipv4.ip_forward=1"].iter().chain(&KUBELET_TUNABLES) {
            assert!(sysctl.split(' ').any(|w| w == *setting), "{setting} not set on the host");
        }
        let target = content(&doc, &target_path);
        assert!(
            target.lines().any(|l| l == "Wants=containerd.service kubelet.service"),
            "{target}"
        );
        assert!(!target.contains("multi-user") && !target.contains("cloud"), "{target}");
    }

    /// The CNI plugin link in a real shell, on scratch folders: made only where /opt/cni/bin is
    /// missing and Debian's plugin folder exists.
    #[test]
    fn the_cni_plugin_folder_is_linked_only_when_missing() {
        let script =
            content(&parsed(&render(&Default::default(), &join()).unwrap(), "p"), JOIN_SCRIPT);
        assert!(script.contains(CNI_BIN_LINK));
        let dir = std::env::temp_dir().join(format!("siteboot-cni-{}", std::process::id()));
        let run = |opt_exists: bool, debian_exists: bool| {
            let _ = std::fs::remove_dir_all(&dir);
            let (opt, debian) = (dir.join("opt/cni"), dir.join("usr/lib/cni"));
            std::fs::create_dir_all(&dir).unwrap();
            if opt_exists {
                std::fs::create_dir_all(opt.join("bin")).unwrap();
            }
            if debian_exists {
                std::fs::create_dir_all(&debian).unwrap();
            }
            let snippet = CNI_BIN_LINK
                .replace("/opt/cni", opt.to_str().unwrap())
                .replace("/usr/lib/cni", debian.to_str().unwrap());
            let out =
                std::process::Command::new("/bin/sh").arg("-c").arg(snippet).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            std::fs::read_link(opt.join("bin")).ok().map(|t| t == debian)
        };
        assert_eq!(run(false, true), Some(true), "linked to Debian's folder");
        assert_eq!(run(true, true), None, "an existing folder is left alone");
        assert_eq!(run(false, false), None, "nothing to link to");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn labels_and_taints_reach_the_kubelet() {
        let spec = SitebootConfigSpec {
            node_labels: BTreeMap::from([
                ("example.com/pool".into(), "gpu".into()),
                ("tier".into(), "".into()),
            ]),
            node_taints: vec![NodeTaint {
                key: "dedicated".into(),
                value: Some("ml".into()),
                effect: TaintEffect::NoExecute,
            }],
            ..Default::default()
        };
        let doc = parsed(&render(&spec, &join()).unwrap(), "p");
        let drop_in = content(&doc, "/etc/systemd/system/kubelet.service.d/zz-siteboot.conf");
        assert!(drop_in.contains(" --node-labels=example.com/pool=gpu,tier=\n"), "{drop_in}");
        let kubelet: Value =
            serde_norway::from_str(&content(&doc, KUBELET_CONFIG_RENDERED)).unwrap();
        assert_eq!(
            kubelet["registerWithTaints"][1],
            json!({ "key": "dedicated", "value": "ml", "effect": "NoExecute" })
        );
    }

    #[test]
    fn hostile_labels_taints_and_files_are_refused() {
        let label = |k: &str, v: &str| SitebootConfigSpec {
            node_labels: BTreeMap::from([(k.to_owned(), v.to_owned())]),
            ..Default::default()
        };
        let taint = |k: &str, v: &str| SitebootConfigSpec {
            node_taints: vec![NodeTaint {
                key: k.into(),
                value: Some(v.into()),
                effect: TaintEffect::NoSchedule,
            }],
            ..Default::default()
        };
        let file =
            |path: &str, permissions: Option<&str>, owner: Option<&str>| SitebootConfigSpec {
                files: vec![BootstrapFile {
                    path: path.into(),
                    content: "x".into(),
                    permissions: permissions.map(Into::into),
                    owner: owner.map(Into::into),
                }],
                ..Default::default()
            };
        let refused = [
            (label("a,b=c", "x"), "comma injects a label"),
            (label("a", "x,evil=1"), "comma in value"),
            (label("a", "x --register-node=false"), "space injects a flag"),
            (label("a", "{{ ds.meta_data }}"), "jinja"),
            (label("a", "%n"), "systemd specifier"),
            (label("a", "$HOME"), "systemd expansion"),
            (label("a\nExecStartPre=/bin/evil", "x"), "newline into the unit"),
            (label("Bad.Prefix/a", "x"), "uppercase prefix"),
            (label("", "x"), "empty key"),
            (label("a", &"x".repeat(64)), "too long"),
            (taint("a", "x\"}]"), "quote in taint value"),
            (taint("{% raw %}", "x"), "jinja taint key"),
            (file("relative/path", None, None), "relative path"),
            (file("/etc/{{ x }}", None, None), "jinja in path"),
            (file("/etc/a\nruncmd: [reboot]", None, None), "newline in path"),
            (file("/etc/a", Some("0999"), None), "bad mode"),
            (file("/etc/a", Some("0644; reboot"), None), "injected mode"),
            (file("/etc/a", None, Some("root:root\nx")), "injected owner"),
            (
                SitebootConfigSpec { pre_commands: vec!["a\0b".into()], ..Default::default() },
                "NUL in a command",
            ),
        ];
        for (spec, why) in refused {
            assert!(render(&spec, &join()).is_err(), "{why} was rendered");
            assert!(validate(&spec).is_err(), "{why} validated");
        }
        assert!(validate(&file("/etc/a", Some("600"), Some("app:app-group"))).is_ok());
    }

    /// Hostile file contents and commands: their text survives byte-exact, adds no jinja, no
    /// YAML keys and no shell outside its own `sh -c`.
    #[test]
    fn hostile_contents_and_commands_stay_in_their_place() {
        let hostile = [
            "{{ ds.meta_data.provider_id }}",
            "{% endraw %}{% include '/etc/shadow' %}",
            "'; reboot; echo '",
            "\"; reboot; \"",
            "$(reboot) `reboot`",
            "line\nruncmd: [reboot]\n---\n#cloud-config",
            "exit 0",
            "fail() { :; }",
        ];
        let spec = SitebootConfigSpec {
            files: hostile
                .iter()
                .enumerate()
                .map(|(i, c)| BootstrapFile {
                    path: format!("/etc/hostile-{i}"),
                    content: (*c).into(),
                    permissions: None,
                    owner: None,
                })
                .collect(),
            pre_commands: hostile.iter().map(|c| (*c).into()).collect(),
            post_commands: hostile.iter().map(|c| (*c).into()).collect(),
            ..Default::default()
        };
        let data = render(&spec, &join()).unwrap();
        assert_eq!(jinja_markers(&data.0).len(), 1, "{:?}", jinja_markers(&data.0));
        let doc = parsed(&data, "p");
        assert_eq!(doc.as_object().unwrap().len(), 2, "only write_files and runcmd");
        assert_eq!(doc["runcmd"], json!([["/bin/sh", JOIN_SCRIPT]]));
        for (i, c) in hostile.iter().enumerate() {
            assert_eq!(content(&doc, &format!("/etc/hostile-{i}")), *c);
        }
        // Each command, read back by a real shell from its quoted word, is its exact text.
        let script = content(&doc, JOIN_SCRIPT);
        for c in hostile {
            let line = format!("/bin/sh -c {} ||", shell_quote(c));
            assert_eq!(script.matches(&line).count(), 2, "{c:?} not quoted in place");
            let out = std::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_quote(c)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), c);
        }
        assert!(!script.contains("FAILED: '"), "a failure names the index, not the command");
    }
}
