//! Which Hosts a SitebootMachine may be given. Pure, so the rules are unit-tested.

use std::collections::HashMap;
use std::fmt;

use kube::ResourceExt;

use crate::conditions::paused_itself;
use crate::crd::{HardwareSelector, Host, HostSelector, HostState, SITE_LABEL};
use crate::pools::HostPools;

/// Why a host is not a candidate (the first reason found), for the "no host" condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Excluded {
    NotAvailable,
    Claimed,
    Maintenance,
    Offline,
    Deleting,
    OtherSite,
    Labels,
    Hardware,
    /// Another Host of the site owns its boot MAC ([`HostPools::mac_owner`]).
    DuplicateBootMac,
    /// The `cluster.x-k8s.io/paused` annotation: nothing writes to the Host, a claim included.
    Paused,
}

impl fmt::Display for Excluded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Excluded::NotAvailable => "not Available",
            Excluded::Claimed => "claimed",
            Excluded::Maintenance => "in maintenance",
            Excluded::Offline => "offline",
            Excluded::Deleting => "being deleted",
            Excluded::OtherSite => "in another site",
            Excluded::Labels => "without the selector's labels",
            Excluded::Hardware => "without the required hardware",
            Excluded::DuplicateBootMac => "whose boot MAC another Host owns",
            Excluded::Paused => "paused",
        })
    }
}

/// The Hosts one machine may be given, and the owner of each boot MAC (worked out once, for
/// every question a pass asks).
pub struct Pool<'a> {
    hosts: Vec<&'a Host>,
    /// By lowercase boot MAC, over the site's Hosts of every namespace: a Host elsewhere may own
    /// the MAC of one here.
    owners: HashMap<String, &'a Host>,
}

impl<'a> Pool<'a> {
    /// The Hosts of `namespace` among the site's `hosts`.
    pub fn new(
        hosts: impl IntoIterator<Item = &'a Host>,
        namespace: &str,
        pools: &HostPools,
    ) -> Self {
        let mut by_mac: HashMap<String, Vec<&Host>> = HashMap::new();
        for h in hosts {
            by_mac.entry(h.spec.boot_mac_address.to_ascii_lowercase()).or_default().push(h);
        }
        let hosts = by_mac
            .values()
            .flatten()
            .copied()
            .filter(|h| h.namespace().as_deref() == Some(namespace))
            .collect();
        let owners = by_mac
            .into_iter()
            .filter_map(|(mac, hosts)| Some((mac, pools.mac_owner(hosts)?)))
            .collect();
        Self { hosts, owners }
    }

    pub fn hosts(&self) -> impl Iterator<Item = &'a Host> + '_ {
        self.hosts.iter().copied()
    }

    /// Whether a host already claimed for a machine still fits it: every rule of
    /// [`Pool::claimable`] but the claim itself.
    pub fn fits(
        &self,
        host: &Host,
        selector: Option<&HostSelector>,
        site: Option<&str>,
    ) -> Result<(), Excluded> {
        self.unique(host)?;
        not_deleting(host)?;
        suits(host, selector, site)
    }

    /// Whether `host` can be claimed for a machine with `selector`, in `site` (the Machine's
    /// failure domain) if it has one.
    pub fn claimable(
        &self,
        host: &Host,
        selector: Option<&HostSelector>,
        site: Option<&str>,
    ) -> Result<(), Excluded> {
        check(host, selector, site)?;
        self.unique(host)
    }

    /// Whether `host` (one of the Hosts the pool was made from) owns its boot MAC.
    fn unique(&self, host: &Host) -> Result<(), Excluded> {
        match self.owners.get(&host.spec.boot_mac_address.to_ascii_lowercase()) {
            Some(owner) if !std::ptr::eq(*owner, host) => Err(Excluded::DuplicateBootMac),
            _ => Ok(()),
        }
    }

    /// The candidates, in the order to try them. The order is shuffled with `seed` so that two
    /// appliances claiming at once mostly try different hosts (the claim itself is a
    /// compare-and-swap either way).
    pub fn candidates(
        &self,
        selector: Option<&HostSelector>,
        site: Option<&str>,
        seed: u64,
    ) -> Vec<&'a Host> {
        let mut found: Vec<&Host> =
            self.hosts().filter(|h| self.claimable(h, selector, site).is_ok()).collect();
        found.sort_by_key(|h| {
            let name = h.metadata.name.as_deref().unwrap_or("");
            // FNV-1a of the name, mixed with the seed: deterministic per seed, spread across seeds.
            name.bytes().fold(0xcbf2_9ce4_8422_2325u64 ^ seed, |acc, b| {
                (acc ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            })
        });
        found
    }

    /// A one-line summary of why nothing matched, e.g. "3 hosts: 2 claimed, 1 in maintenance".
    pub fn explain(&self, selector: Option<&HostSelector>, site: Option<&str>) -> String {
        let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
        for h in self.hosts() {
            if let Err(e) = self.claimable(h, selector, site) {
                *counts.entry(e.to_string()).or_default() += 1;
            }
        }
        let parts: Vec<String> = counts.iter().map(|(why, n)| format!("{n} {why}")).collect();
        format!(
            "{} hosts: {}",
            self.hosts.len(),
            if parts.is_empty() { "none excluded".into() } else { parts.join(", ") }
        )
    }
}

/// Every rule for one host on its own (a shared boot MAC needs the [`Pool`]).
fn check(host: &Host, selector: Option<&HostSelector>, site: Option<&str>) -> Result<(), Excluded> {
    not_deleting(host)?;
    if host.spec.consumer_ref.is_some() {
        return Err(Excluded::Claimed);
    }
    if paused_itself(host) {
        return Err(Excluded::Paused);
    }
    suits(host, selector, site)
}

fn not_deleting(host: &Host) -> Result<(), Excluded> {
    if host.metadata.deletion_timestamp.is_some() {
        return Err(Excluded::Deleting);
    }
    Ok(())
}

/// The rules about the host itself, whoever has claimed it.
fn suits(host: &Host, selector: Option<&HostSelector>, site: Option<&str>) -> Result<(), Excluded> {
    let status = host.status.as_ref();
    if status.and_then(|s| s.state) != Some(HostState::Available) {
        return Err(Excluded::NotAvailable);
    }
    if host.spec.maintenance {
        return Err(Excluded::Maintenance);
    }
    if !host.spec.online {
        return Err(Excluded::Offline);
    }
    let labels = host.metadata.labels.as_ref();
    if let Some(site) = site
        && labels.and_then(|l| l.get(SITE_LABEL)).map(String::as_str) != Some(site)
    {
        return Err(Excluded::OtherSite);
    }
    match selector {
        Some(selector) => selected(host, selector),
        None => Ok(()),
    }
}

/// Whether `host` has the labels and the hardware `selector` asks for (whatever its state,
/// site or claim: also what a machine template's capacity is worked out from).
pub fn selected(host: &Host, selector: &HostSelector) -> Result<(), Excluded> {
    let labels = host.metadata.labels.as_ref();
    for (k, v) in &selector.match_labels {
        if labels.and_then(|l| l.get(k)) != Some(v) {
            return Err(Excluded::Labels);
        }
    }
    if let Some(hw) = &selector.hardware
        && !hardware_matches(host, hw)
    {
        return Err(Excluded::Hardware);
    }
    Ok(())
}

fn hardware_matches(host: &Host, want: &HardwareSelector) -> bool {
    let Some(hw) = host.status.as_ref().and_then(|s| s.hardware.as_ref()) else {
        // Qualifiers need inspection data: an uninspected host matches only an empty selector.
        return want == &HardwareSelector::default();
    };
    let largest_disk = hw.disks.iter().map(|d| d.size_bytes).max().unwrap_or(0);
    want.min_cpus.is_none_or(|n| hw.cpus >= n)
        && want.min_memory_mib.is_none_or(|m| hw.memory_mib >= m)
        && want.min_disk_bytes.is_none_or(|b| largest_disk >= b)
        && want.arch.as_ref().is_none_or(|a| hw.arch.as_ref() == Some(a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{ConsumerRef, Disk, Hardware, HostSpec, HostStatus};
    use crate::pools::Tenants;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use std::collections::BTreeMap;

    fn host(name: &str, site: &str, state: HostState) -> Host {
        // A MAC of the name's own: a shared boot MAC excludes both hosts.
        let n = name.bytes().fold(0u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
        let mut h = Host::new(name, HostSpec::new(format!("52:54:00:00:01:{n:02x}")));
        h.metadata.namespace = Some("ns".into());
        h.metadata.labels = Some(BTreeMap::from([
            (SITE_LABEL.to_owned(), site.to_owned()),
            ("rack".into(), "r1".into()),
        ]));
        h.status = Some(HostStatus { state: Some(state), ..Default::default() });
        h
    }

    #[test]
    fn only_available_unclaimed_matching_hosts_are_candidates() {
        let ok = host("a", "s1", HostState::Available);
        assert_eq!(check(&ok, None, Some("s1")), Ok(()));
        assert_eq!(check(&ok, None, None), Ok(()));
        assert_eq!(check(&ok, None, Some("s2")), Err(Excluded::OtherSite));
        assert_eq!(
            check(&host("b", "s1", HostState::Provisioned), None, None),
            Err(Excluded::NotAvailable)
        );
        let mut claimed = ok.clone();
        claimed.spec.consumer_ref = Some(ConsumerRef {
            api_version: "v".into(),
            kind: "k".into(),
            namespace: "n".into(),
            name: "m".into(),
            uid: "u".into(),
        });
        assert_eq!(check(&claimed, None, None), Err(Excluded::Claimed));
        let mut cordoned = ok.clone();
        cordoned.spec.maintenance = true;
        assert_eq!(check(&cordoned, None, None), Err(Excluded::Maintenance));
        let mut paused = ok.clone();
        paused.metadata.annotations =
            Some([(crate::crd::capi::PAUSED_ANNOTATION.to_owned(), String::new())].into());
        assert_eq!(check(&paused, None, None), Err(Excluded::Paused));

        let labels = HostSelector {
            match_labels: BTreeMap::from([("rack".into(), "r2".into())]),
            ..Default::default()
        };
        assert_eq!(check(&ok, Some(&labels), None), Err(Excluded::Labels));
        let hw = HostSelector {
            hardware: Some(HardwareSelector {
                min_cpus: Some(4),
                min_disk_bytes: Some(100),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(check(&ok, Some(&hw), None), Err(Excluded::Hardware), "not inspected");
        let mut big = ok.clone();
        big.status.as_mut().unwrap().hardware = Some(Hardware {
            cpus: 8,
            disks: vec![Disk {
                name: "sda".into(),
                size_bytes: 200,
                model: None,
                serial: None,
                wwn: None,
                rotational: false,
            }],
            ..Default::default()
        });
        assert_eq!(check(&big, Some(&hw), None), Ok(()));
        assert_eq!(
            Pool::new([&ok, &claimed, &cordoned], "ns", &HostPools::default())
                .explain(Some(&labels), None),
            "3 hosts: 1 claimed, 1 in maintenance, 1 without the selector's labels"
        );
    }

    #[test]
    fn a_claimed_host_may_still_fit_unless_another_owns_its_mac() {
        let mut claimed = host("a", "s1", HostState::Available);
        claimed.spec.consumer_ref = Some(ConsumerRef {
            api_version: "v".into(),
            kind: "k".into(),
            namespace: "n".into(),
            name: "m".into(),
            uid: "u".into(),
        });
        let pool = Pool::new([&claimed], "ns", &HostPools::default());
        assert_eq!(pool.fits(&claimed, None, Some("s1")), Ok(()));
        assert_eq!(pool.claimable(&claimed, None, Some("s1")), Err(Excluded::Claimed));
        assert_eq!(pool.fits(&claimed, None, Some("s2")), Err(Excluded::OtherSite));
        // A later Host with its MAC: the first keeps it, the twin is never a candidate.
        let mut twin = host("b", "s1", HostState::Available);
        twin.spec.boot_mac_address = claimed.spec.boot_mac_address.to_ascii_uppercase();
        claimed.metadata.creation_timestamp = Some(created(1));
        twin.metadata.creation_timestamp = Some(created(2));
        let pool = Pool::new([&twin, &claimed], "ns", &HostPools::default());
        assert_eq!(pool.fits(&claimed, None, None), Ok(()));
        assert_eq!(pool.fits(&twin, None, None), Err(Excluded::DuplicateBootMac));
        assert_eq!(pool.claimable(&twin, None, None), Err(Excluded::DuplicateBootMac));
        assert!(pool.candidates(None, None, 0).is_empty());
    }

    fn created(second: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(second).unwrap())
    }

    /// A tenant's Host with a pool host's MAC, made before or after it: the pool's host stays a
    /// candidate for the pool's tenants, the copy is none for its own namespace's machines.
    #[test]
    fn a_copied_mac_excludes_only_the_copy() {
        let pools = HostPools::new([("pool".to_owned(), Tenants::Any)]);
        let mut pooled = host("node-1", "s1", HostState::Available);
        pooled.metadata.namespace = Some("pool".into());
        pooled.metadata.creation_timestamp = Some(created(2));
        let mut copy = pooled.clone();
        copy.metadata.name = Some("copy".into());
        copy.metadata.namespace = Some("team-b".into());
        for copied_at in [1, 3] {
            copy.metadata.creation_timestamp = Some(created(copied_at));
            let site = [&copy, &pooled];
            let names = |pool: &Pool| -> Vec<String> {
                pool.candidates(None, None, 0).iter().map(|h| h.name_any()).collect()
            };
            assert_eq!(names(&Pool::new(site, "pool", &pools)), ["node-1"]);
            let tenant = Pool::new(site, "team-b", &pools);
            assert!(names(&tenant).is_empty());
            assert_eq!(tenant.explain(None, None), "1 hosts: 1 whose boot MAC another Host owns");
        }
    }

    #[test]
    fn candidate_order_depends_on_the_seed() {
        let hosts: Vec<Host> =
            (0..8).map(|i| host(&format!("h{i}"), "s", HostState::Available)).collect();
        let order = |seed| {
            Pool::new(&hosts, "ns", &HostPools::default())
                .candidates(None, None, seed)
                .iter()
                .map(|h| h.metadata.name.clone().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(order(1).len(), 8);
        assert_eq!(order(1), order(1));
        assert!((2..10).any(|s| order(s)[0] != order(1)[0]), "different seeds start elsewhere");
    }
}
