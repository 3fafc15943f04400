//! Who may be given which Hosts: the operator's host pools (namespaces of Hosts that machines of
//! other namespaces may take, and which tenant namespaces may), and which Host owns a boot MAC
//! that more than one Host names. Pure, so the rules are unit-tested.
//!
//! Whoever may write Hosts in a namespace decides what machines of that namespace, and of the
//! pool's tenants, may be given. A tenant's own namespace is its own business; a pool namespace
//! is the operator's (see docs/security.md).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use kube::ResourceExt;

use crate::conditions::Reason;
use crate::crd::Host;

/// Which tenant namespaces may take Hosts from a pool namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tenants {
    /// Every namespace (the plain `host_namespaces: [name]` form).
    Any,
    Only(BTreeSet<String>),
}

/// The pool namespaces of a site and their tenants (`kubernetes.host_namespaces`). A machine
/// may always take Hosts of its own namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPools(BTreeMap<String, Tenants>);

/// Why a machine may not take Hosts from a namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotAllowed {
    /// The namespace is not a pool at all.
    NotAPool { pool: String },
    /// The namespace is a pool, and the machine's namespace is not among its tenants.
    NotATenant { pool: String, tenant: String },
}

impl fmt::Display for NotAllowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotAllowed::NotAPool { pool } => write!(
                f,
                "hostSelector.namespace {pool:?} is not one this appliance may take hosts from (kubernetes.host_namespaces)"
            ),
            NotAllowed::NotATenant { pool, tenant } => write!(
                f,
                "namespace {tenant:?} is not a tenant of host pool {pool:?} (kubernetes.host_namespaces[].tenants)"
            ),
        }
    }
}

impl HostPools {
    pub fn new(pools: impl IntoIterator<Item = (String, Tenants)>) -> Self {
        Self(pools.into_iter().collect())
    }

    /// Whether machines of namespace `tenant` may be given Hosts of namespace `hosts`.
    pub fn may_take(&self, tenant: &str, hosts: &str) -> Result<(), NotAllowed> {
        if tenant == hosts {
            return Ok(());
        }
        match self.0.get(hosts) {
            None => Err(NotAllowed::NotAPool { pool: hosts.to_owned() }),
            Some(Tenants::Any) => Ok(()),
            Some(Tenants::Only(tenants)) if tenants.contains(tenant) => Ok(()),
            Some(Tenants::Only(_)) => {
                Err(NotAllowed::NotATenant { pool: hosts.to_owned(), tenant: tenant.to_owned() })
            }
        }
    }

    /// Whether `namespace` is one of the operator's pools.
    pub fn is_pool(&self, namespace: &str) -> bool {
        self.0.contains_key(namespace)
    }

    /// The Host that owns the boot MAC all of `hosts` name: the others never boot nor are
    /// claimed. A Host in a pool namespace (written by operators) comes before one in any other
    /// namespace (which a tenant may write), so a tenant can neither disable a pool host nor
    /// take its machine by naming its MAC first; otherwise the Host that had it first
    /// (creationTimestamp, then uid), so a newcomer never disables an existing host.
    pub fn mac_owner<'h>(&self, hosts: impl IntoIterator<Item = &'h Host>) -> Option<&'h Host> {
        hosts.into_iter().min_by_key(|h| {
            let outside_pools = !self.is_pool(&h.namespace().unwrap_or_default());
            let created = h.metadata.creation_timestamp.clone();
            (outside_pools, created.is_none(), created, h.uid())
        })
    }
}

/// Where a Host stands among the Hosts with its boot MAC (its BootMACUnique condition).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MacStanding {
    /// No other Host of the site has it.
    Unique,
    /// Others have it too, and this Host keeps it. `here`: the others in its own namespace;
    /// `elsewhere`: how many in other namespaces (not named: its editor may not know them).
    Owner { here: Vec<String>, elsewhere: usize },
    /// Another Host owns it: this one never boots nor is claimed. `owner`: that Host's name if
    /// it is in this Host's namespace, else `None` (nothing of another namespace is named).
    Duplicate { owner: Option<String> },
}

impl HostPools {
    /// Where `host` stands, given the other Hosts of the site with its boot MAC.
    pub fn mac_standing(&self, host: &Host, others: &[&Host]) -> MacStanding {
        if others.is_empty() {
            return MacStanding::Unique;
        }
        let namespace = host.namespace();
        let owner = self.mac_owner(others.iter().copied().chain([host])).unwrap_or(host);
        if !std::ptr::eq(owner, host) {
            let owner = (owner.namespace() == namespace).then(|| owner.name_any());
            return MacStanding::Duplicate { owner };
        }
        let (here, elsewhere): (Vec<&Host>, Vec<&Host>) =
            others.iter().partition(|h| h.namespace() == namespace);
        let mut here: Vec<String> = here.iter().map(|h| h.name_any()).collect();
        here.sort();
        MacStanding::Owner { here, elsewhere: elsewhere.len() }
    }
}

impl MacStanding {
    /// The BootMACUnique condition: (status, reason, message) for a Host with boot MAC `mac`.
    pub fn condition(&self, mac: &str) -> (bool, Reason, String) {
        match self {
            MacStanding::Unique => (true, Reason::BootMACUnique, String::new()),
            MacStanding::Owner { here, elsewhere } => {
                let mut who: Vec<String> = here.iter().map(|name| format!("Host {name}")).collect();
                if *elsewhere > 0 {
                    who.push(format!("{elsewhere} Host(s) in other namespaces"));
                }
                let message = format!(
                    "{} also name boot MAC {mac}; this Host keeps it (it is in a host pool or had it first), the others never boot nor are claimed",
                    who.join(" and ")
                );
                (true, Reason::BootMACOwned, message)
            }
            MacStanding::Duplicate { owner } => {
                let owner = match owner {
                    Some(name) => format!("Host {name} owns boot MAC {mac} (it had it first)"),
                    None => format!(
                        "a Host in another namespace owns boot MAC {mac} (it is in a host pool or had it first)"
                    ),
                };
                let message = format!(
                    "{owner}: this Host never boots nor is claimed until its boot MAC is changed"
                );
                (false, Reason::DuplicateBootMAC, message)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::HostSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn pools() -> HostPools {
        HostPools::new([
            ("pool-a".to_owned(), Tenants::Only(["team-a".to_owned()].into())),
            ("shared".to_owned(), Tenants::Any),
        ])
    }

    #[test]
    fn tenants_take_from_their_own_namespace_and_the_pools_that_list_them() {
        let pools = pools();
        assert_eq!(pools.may_take("team-b", "team-b"), Ok(()));
        assert_eq!(pools.may_take("team-a", "pool-a"), Ok(()));
        assert_eq!(pools.may_take("pool-a", "pool-a"), Ok(()));
        assert_eq!(
            pools.may_take("team-b", "pool-a"),
            Err(NotAllowed::NotATenant { pool: "pool-a".into(), tenant: "team-b".into() })
        );
        assert_eq!(pools.may_take("team-b", "shared"), Ok(()));
        assert_eq!(
            pools.may_take("team-a", "team-b"),
            Err(NotAllowed::NotAPool { pool: "team-b".into() })
        );
        assert_eq!(
            HostPools::default().may_take("team-a", "pool-a"),
            Err(NotAllowed::NotAPool { pool: "pool-a".into() })
        );
    }

    fn host(namespace: &str, name: &str, created: i64, uid: &str) -> Host {
        let mut h = Host::new(name, HostSpec::new("52:54:00:00:00:01"));
        h.metadata.namespace = Some(namespace.into());
        h.metadata.uid = Some(uid.into());
        h.metadata.creation_timestamp =
            Some(Time(k8s_openapi::jiff::Timestamp::from_second(created).unwrap()));
        h
    }

    fn owner(hosts: &[&Host]) -> String {
        let owner = pools().mac_owner(hosts.iter().copied()).unwrap();
        format!("{}/{}", owner.namespace().unwrap(), owner.name_any())
    }

    /// Every pairing of pool and tenant namespaces, older and newer, in both orders.
    #[test]
    fn the_owner_of_a_shared_boot_mac() {
        let pool_old = host("pool-a", "old", 100, "u1");
        let pool_new = host("pool-a", "new", 200, "u2");
        let shared_new = host("shared", "late", 300, "u3");
        let tenant_old = host("team-b", "planted", 50, "u4");
        let tenant_new = host("team-b", "copy", 400, "u5");
        let other_tenant = host("team-c", "copy", 500, "u6");
        let cases: [(&[&Host], &str); 8] = [
            // A pool's Host wins over a tenant's, even one made before it.
            (&[&tenant_old, &pool_new], "pool-a/new"),
            (&[&pool_new, &tenant_new], "pool-a/new"),
            // Among pools, and among tenants: the first to have it.
            (&[&shared_new, &pool_old], "pool-a/old"),
            (&[&pool_new, &pool_old], "pool-a/old"),
            (&[&other_tenant, &tenant_new], "team-b/copy"),
            (&[&tenant_new, &other_tenant], "team-b/copy"),
            (&[&tenant_new, &tenant_old, &other_tenant, &shared_new], "shared/late"),
            (&[&tenant_old], "team-b/planted"),
        ];
        for (hosts, want) in cases {
            assert_eq!(
                owner(hosts),
                want,
                "{:?}",
                hosts.iter().map(|h| h.uid()).collect::<Vec<_>>()
            );
        }
        // Made in the same second: the uid decides, whatever the order they are listed in.
        let twin = host("pool-a", "twin", 100, "u0");
        assert_eq!(owner(&[&pool_old, &twin]), "pool-a/twin");
        assert_eq!(owner(&[&twin, &pool_old]), "pool-a/twin");
        // No creationTimestamp (never from the apiserver): last.
        let mut undated = host("pool-a", "undated", 0, "u00");
        undated.metadata.creation_timestamp = None;
        assert_eq!(owner(&[&undated, &pool_new]), "pool-a/new");
        assert!(pools().mac_owner([]).is_none());
    }

    /// A tenant's condition names only Hosts of its own namespace; the owner's counts the rest.
    #[test]
    fn a_condition_names_nothing_of_another_namespace() {
        let pools = pools();
        let pooled = host("pool-a", "node-1", 100, "u1");
        let copy = host("team-b", "copy", 200, "u2");
        let second = host("team-b", "copy-2", 300, "u3");
        let mac = "52:54:00:00:00:01";
        assert_eq!(pools.mac_standing(&pooled, &[]), MacStanding::Unique);
        assert!(pools.mac_standing(&pooled, &[]).condition(mac).0);
        let standing = pools.mac_standing(&copy, &[&pooled, &second]);
        assert_eq!(standing, MacStanding::Duplicate { owner: None });
        let (ok, reason, message) = standing.condition(mac);
        assert_eq!((ok, reason), (false, Reason::DuplicateBootMAC));
        assert!(!message.contains("pool-a") && !message.contains("node-1"), "{message}");
        assert!(message.contains(mac), "{message}");
        // Two tenant Hosts, no pool Host: the older owns it, and the newer may know its name.
        let standing = pools.mac_standing(&second, &[&copy]);
        assert_eq!(standing, MacStanding::Duplicate { owner: Some("copy".into()) });
        assert!(standing.condition(mac).2.contains("Host copy owns"));
        let standing = pools.mac_standing(&pooled, &[&second, &copy]);
        assert_eq!(standing, MacStanding::Owner { here: vec![], elsewhere: 2 });
        let (ok, reason, message) = standing.condition(mac);
        assert_eq!((ok, reason), (true, Reason::BootMACOwned));
        assert!(!message.contains("team-b") && !message.contains("copy"), "{message}");
        let standing = pools.mac_standing(&copy, &[&second]);
        assert_eq!(standing, MacStanding::Owner { here: vec!["copy-2".into()], elsewhere: 0 });
    }
}
