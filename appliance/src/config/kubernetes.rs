//! The `kubernetes:` section (the `kubernetes` feature): Kubernetes mode's site, ramdisk and
//! host pools, in place of `hosts` and `unknown_hosts`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;
use siteboot_agent_server::WipePolicy;
use siteboot_boot::dhcp::settings::FieldError;
use siteboot_boot::inventory::{BootAction, LinuxBoot};
use siteboot_controller::pools::{HostPools, Tenants};

use super::{ConfigFile, default_ramdisk_silence_timeout, default_wipe, ramdisk_boot};

/// The `kubernetes:` section: this appliance's site and how its hosts' ramdisk boots.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesFile {
    /// The site this appliance serves (Hosts labelled `siteboot.dev/site=<site>`); `--site`
    /// overrides it.
    pub site: Option<String>,
    /// The profile (kernel + initrds) of the deploy ramdisk that inspects, images and wipes
    /// hosts; siteboot adds the operation's token to its command line.
    pub ramdisk_profile: String,
    /// The deploy ramdisk as a boot ISO (an absolute path), for hosts booted through their
    /// BMC's virtual media: served on `http.https_port` at `/media/<key>.iso`, with the
    /// operation's kernel command line (its token included) written into the ISO's parameters
    /// region for each request, so the token never crosses the provisioning segment in clear.
    /// The file is read once at start-up (and by `siteboot check-config`): one that is not
    /// such an ISO stops start-up. Unset: no boot media (`/media/` answers 404).
    pub ramdisk_media: Option<PathBuf>,
    /// Where the site's leader Lease lives.
    #[serde(default = "default_lease_namespace")]
    pub lease_namespace: String,
    /// Elect one leader per site for the reconcilers and full-mode DHCP.
    #[serde(default = "default_true")]
    pub leader_election: bool,
    /// How long a ramdisk token is accepted after it is issued.
    #[serde(default = "default_token_max_age", with = "humantime_serde")]
    pub token_max_age: std::time::Duration,
    /// How long a ramdisk that booted for an operation may go without reporting before its
    /// host is quarantined (reason `RamdiskSilent`). The agent reports every few seconds
    /// while it works.
    #[serde(default = "default_ramdisk_silence_timeout", with = "humantime_serde")]
    pub ramdisk_silence_timeout: std::time::Duration,
    /// The operator's host pools: namespaces, besides a SitebootMachine's own, that its
    /// `hostSelector.namespace` may take Hosts from, each with the tenant namespaces that may.
    /// None by default: a machine gets Hosts of its own namespace only. Whoever may write Hosts
    /// in a pool decides what its tenants' machines are given: grant that to operators only.
    /// A Host in a pool also keeps a boot MAC that a Host elsewhere names too.
    #[serde(default)]
    pub host_namespaces: Vec<HostNamespaceFile>,
    /// The least wipe a used host gets before another tenant may have it: `quick` (partition
    /// tables and signatures; a forensic reader recovers files) or `full` (every block zeroed
    /// and read back). A SitebootMachine's `spec.wipe` or a Host's may ask for more, never
    /// less. `none` only for disposable lab hosts.
    #[serde(default = "default_wipe")]
    pub min_wipe: WipePolicy,
}

/// One entry of `kubernetes.host_namespaces`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum HostNamespaceFile {
    /// `pool`: machines of every namespace may take Hosts of `pool`.
    Open(String),
    /// `{namespace: pool, tenants: [team-a]}`: machines of these namespaces (and of `pool`
    /// itself) only.
    Pool(HostPoolFile),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostPoolFile {
    pub namespace: String,
    pub tenants: Vec<String>,
}

/// The host pools `host_namespaces` lists; a namespace listed twice is refused (which of its
/// tenant lists was meant?).
fn host_pools(entries: &[HostNamespaceFile]) -> Result<HostPools, FieldError> {
    let mut pools = BTreeMap::new();
    for entry in entries {
        let (namespace, tenants) = match entry {
            HostNamespaceFile::Open(namespace) => (namespace, Tenants::Any),
            HostNamespaceFile::Pool(pool) => {
                (&pool.namespace, Tenants::Only(pool.tenants.iter().cloned().collect()))
            }
        };
        if namespace.is_empty() {
            return Err(FieldError::new("kubernetes.host_namespaces", "a namespace is empty"));
        }
        if pools.insert(namespace.clone(), tenants).is_some() {
            return Err(FieldError::new(
                "kubernetes.host_namespaces",
                format!("namespace {namespace:?} is listed twice"),
            ));
        }
    }
    Ok(HostPools::new(pools))
}

fn default_token_max_age() -> std::time::Duration {
    siteboot_agent_server::silence::TOKEN_MAX_AGE
}

fn default_lease_namespace() -> String {
    siteboot_controller::context::DEFAULT_NAMESPACE.to_owned()
}

fn default_true() -> bool {
    true
}

/// Kubernetes mode, checked.
#[derive(Debug)]
pub struct KubernetesConfig {
    pub site: Option<String>,
    pub ramdisk: LinuxBoot,
    pub lease_namespace: String,
    pub leader_election: bool,
    pub token_max_age: std::time::Duration,
    pub ramdisk_silence_timeout: std::time::Duration,
    pub host_pools: HostPools,
    pub min_wipe: WipePolicy,
}

/// The `kubernetes:` section, which takes the place of `hosts` and `unknown_hosts`.
pub(super) fn check(
    k: &KubernetesFile,
    file: &ConfigFile,
    profiles: &BTreeMap<String, BootAction>,
) -> Result<KubernetesConfig, FieldError> {
    if !file.hosts.is_empty() || file.unknown_hosts.is_some() {
        return Err(FieldError::new(
            "kubernetes",
            "hosts and unknown_hosts do not apply in Kubernetes mode: what each host boots follows its Host object",
        ));
    }
    if let Some(site) = &k.site {
        check_site_name(site, "kubernetes.site")?;
    }
    let ramdisk = ramdisk_boot(profiles, &k.ramdisk_profile, "kubernetes.ramdisk_profile")?;
    if let Some(path) = &k.ramdisk_media
        && !path.is_absolute()
    {
        return Err(FieldError::new(
            "kubernetes.ramdisk_media",
            format!("{}: give an absolute path", path.display()),
        ));
    }
    Ok(KubernetesConfig {
        site: k.site.clone(),
        ramdisk,
        lease_namespace: k.lease_namespace.clone(),
        leader_election: k.leader_election,
        token_max_age: k.token_max_age,
        ramdisk_silence_timeout: k.ramdisk_silence_timeout,
        host_pools: host_pools(&k.host_namespaces)?,
        min_wipe: k.min_wipe,
    })
}

/// Site names are label values and object names: DNS-1123 labels.
pub fn check_site_name(site: &str, field: &str) -> Result<(), FieldError> {
    let ok = !site.is_empty()
        && site.len() <= 63
        && site.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !site.starts_with('-')
        && !site.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{site:?} is not a site name (lower-case letters, digits and '-', at most 63)"),
        ))
    }
}
