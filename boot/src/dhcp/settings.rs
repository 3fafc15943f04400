//! The `dhcp:` section of the configuration, and the checked network plan built from it.
//!
//! The serde types are the documentation of the file format; [`NetworkPlan::new`] turns them
//! into a plan whose invariants hold (pools inside their subnet, no overlaps, reservations
//! inside a subnet and unique), or names the field that is wrong.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::MacAddr;
use crate::decision::DhcpMode;
use crate::metrics::RelayRefusal;

/// The `dhcp:` section. A field left out takes its value from [`Settings::default`], the one
/// place the defaults are written (`examples/standalone.yaml` shows each, checked by a test).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// `full`, `proxy` or `off`.
    pub mode: DhcpMode,
    /// How long a lease lasts unless renewed.
    #[serde(with = "humantime_serde")]
    pub lease_time: Duration,
    /// How long an address a client DECLINEd stays out of the pool. Also the window of the
    /// per-MAC DECLINE budget (see `DhcpServer::decline`): a known host's or reserved address
    /// is never quarantined, any other MAC quarantines at most 2 addresses per window, and at
    /// most half of a subnet's pool is ever quarantined.
    #[serde(with = "humantime_serde")]
    pub decline_quarantine: Duration,
    /// Subnets served: the one containing the server address is local, the others are reached
    /// through relays.
    pub subnets: Vec<SubnetSettings>,
    /// Fixed addresses by MAC.
    pub reservations: Vec<Reservation>,
    /// Full mode: answer only the MACs the inventory knows (listed under `hosts`, or with a
    /// Host object in Kubernetes mode); any other machine gets no address. Unset, the appliance
    /// decides: false standalone, true in Kubernetes mode (where a new machine gets its Host
    /// before it first boots, and so is answered and inspected).
    pub known_hosts_only: Option<bool>,
    /// The DHCP relays whose relayed messages are answered: each by its `giaddr`, and the
    /// addresses its datagrams come from (the `giaddr` itself unless `sources` says
    /// otherwise). A message naming any other relay, or a trusted one's `giaddr` from another
    /// address, is dropped. Empty, the default: relayed messages are refused, since any
    /// machine on the link can put a relay's address in a message.
    pub trusted_relays: Vec<TrustedRelay>,
    /// Full mode: whether a lease ACKed through a trusted relay is, by itself, its client's
    /// identity (a ramdisk token, bootstrap data). Weaker than on-link identity, where an ARP
    /// entry must name the lessee: a machine behind the same relay that forges the lessee's
    /// MAC takes its lease, and with it its token, unless the host is pinned to the relay
    /// agent information of its port ([`Inventory::relay_pin`]): then only a lease granted
    /// through a relay that said what the pin names counts. Off, the default: relayed clients
    /// get addresses and boot files, but no identity.
    ///
    /// [`Inventory::relay_pin`]: crate::inventory::Inventory::relay_pin
    pub trust_relayed_leases: bool,
}

/// A relay whose relayed messages are answered: `10.99.1.1` (it sends from its `giaddr`), or
/// `{giaddr: 10.99.1.1, sources: [10.99.0.2]}` for one that sends from another address (its
/// address towards siteboot).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "TrustedRelayEntry")]
pub struct TrustedRelay {
    /// The address it puts in `giaddr`: its address on its clients' subnet.
    pub giaddr: Ipv4Addr,
    /// The source addresses of its datagrams; never empty.
    pub sources: Vec<Ipv4Addr>,
}

impl TrustedRelay {
    /// A relay that sends from its `giaddr`.
    pub fn at(giaddr: Ipv4Addr) -> Self {
        Self { giaddr, sources: vec![giaddr] }
    }
}

/// `trusted_relays[]` as written: an address, or the long form.
#[derive(Deserialize)]
#[serde(untagged, expecting = "a relay's address, or {giaddr: <address>, sources: [<address>...]}")]
enum TrustedRelayEntry {
    Address(Ipv4Addr),
    Relay(TrustedRelayFields),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TrustedRelayFields {
    giaddr: Ipv4Addr,
    sources: Option<Vec<Ipv4Addr>>,
}

impl TryFrom<TrustedRelayEntry> for TrustedRelay {
    type Error = &'static str;

    fn try_from(entry: TrustedRelayEntry) -> Result<Self, Self::Error> {
        match entry {
            TrustedRelayEntry::Address(giaddr) => Ok(Self::at(giaddr)),
            TrustedRelayEntry::Relay(TrustedRelayFields { giaddr, sources: None }) => {
                Ok(Self::at(giaddr))
            }
            TrustedRelayEntry::Relay(TrustedRelayFields { sources: Some(sources), .. })
                if sources.is_empty() =>
            {
                Err("sources is empty: leave it out for a relay that sends from its giaddr")
            }
            TrustedRelayEntry::Relay(TrustedRelayFields { giaddr, sources: Some(sources) }) => {
                Ok(Self { giaddr, sources })
            }
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            mode: DhcpMode::default(),
            lease_time: Duration::from_secs(3600),
            decline_quarantine: Duration::from_secs(600),
            subnets: Vec::new(),
            reservations: Vec::new(),
            known_hosts_only: None,
            trusted_relays: Vec::new(),
            trust_relayed_leases: false,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubnetSettings {
    /// The network, like `10.99.0.0/24`.
    pub subnet: Ipv4Subnet,
    /// Address ranges handed out dynamically: `first-last`, or a single address.
    #[serde(default)]
    pub pools: Vec<AddrRange>,
    pub router: Option<Ipv4Addr>,
    #[serde(default)]
    pub dns: Vec<Ipv4Addr>,
    pub domain: Option<String>,
    /// Overrides `dhcp.lease_time` for this subnet.
    #[serde(default, with = "humantime_serde")]
    pub lease_time: Option<Duration>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reservation {
    pub mac: MacAddr,
    pub address: Ipv4Addr,
    pub hostname: Option<String>,
}

/// An IPv4 network in CIDR form with no host bits set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Subnet {
    network: u32,
    prefix: u8,
}

impl Ipv4Subnet {
    pub fn mask(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.mask_bits())
    }

    fn mask_bits(&self) -> u32 {
        if self.prefix == 0 { 0 } else { u32::MAX << (32 - self.prefix) }
    }

    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.network)
    }

    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.network | !self.mask_bits())
    }

    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & self.mask_bits() == self.network
    }

    /// Inside the subnet and neither its network nor its broadcast address.
    pub fn is_host(&self, addr: Ipv4Addr) -> bool {
        self.contains(addr)
            && (self.prefix >= 31 || (addr != self.network() && addr != self.broadcast()))
    }
}

impl fmt::Display for Ipv4Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix)
    }
}

impl FromStr for Ipv4Subnet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not in CIDR form like 10.0.0.0/24"))?;
        let addr: Ipv4Addr =
            addr.parse().map_err(|_| format!("{addr:?} is not an IPv4 address"))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| format!("{prefix:?} is not a prefix length 0-32"))?;
        let subnet = Self { network: 0, prefix };
        let network = u32::from(addr) & subnet.mask_bits();
        if network != u32::from(addr) {
            return Err(format!(
                "{s} has host bits set; the network is {}/{prefix}",
                Ipv4Addr::from(network)
            ));
        }
        Ok(Self { network, prefix })
    }
}

/// An inclusive range of IPv4 addresses, `first <= last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddrRange {
    first: u32,
    last: u32,
}

impl AddrRange {
    pub fn first(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.first)
    }

    pub fn last(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.last)
    }

    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        (self.first..=self.last).contains(&u32::from(addr))
    }

    /// The number of addresses in the range (at least 1).
    pub fn size(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    pub fn iter(&self) -> impl Iterator<Item = Ipv4Addr> {
        (self.first..=self.last).map(Ipv4Addr::from)
    }

    fn overlaps(&self, other: &AddrRange) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

impl fmt::Display for AddrRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first(), self.last())
    }
}

impl FromStr for AddrRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |a: &str| {
            a.trim()
                .parse::<Ipv4Addr>()
                .map(u32::from)
                .map_err(|_| format!("{a:?} is not an IPv4 address"))
        };
        let (first, last) = match s.split_once('-') {
            Some((a, b)) => (parse(a)?, parse(b)?),
            None => (parse(s)?, parse(s)?),
        };
        if first > last {
            return Err(format!("range {s:?} ends before it starts"));
        }
        Ok(Self { first, last })
    }
}

macro_rules! deserialize_from_str {
    ($t:ty) => {
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
deserialize_from_str!(Ipv4Subnet);
deserialize_from_str!(AddrRange);

/// A configuration problem: the field (a path like `dhcp.subnets[0].pools[1]`) and what is
/// wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

/// A subnet as served, with its options resolved.
#[derive(Debug, Clone)]
pub struct SubnetPlan {
    pub subnet: Ipv4Subnet,
    pub pools: Vec<AddrRange>,
    pub router: Option<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
    pub domain: Option<String>,
    pub lease_time: Duration,
}

impl SubnetPlan {
    pub fn in_pool(&self, addr: Ipv4Addr) -> bool {
        self.pools.iter().any(|p| p.contains(addr))
    }
}

/// Checked subnets, reservations and relays: what the DHCP server serves.
#[derive(Debug, Clone)]
pub struct NetworkPlan {
    pub subnets: Vec<SubnetPlan>,
    pub reservations: Vec<Reservation>,
    /// In full mode, each `giaddr` inside a subnet (the one its clients get addresses from).
    pub trusted_relays: Vec<TrustedRelay>,
    /// A relayed lease alone is identity (`dhcp.trust_relayed_leases`).
    pub trust_relayed_leases: bool,
    /// Index into `subnets` of the subnet containing the server address, if any.
    pub local: Option<usize>,
    pub decline_quarantine: Duration,
}

/// Pools larger than this are refused: the lease table keeps every free address in memory.
const MAX_POOL_ADDRESSES: u64 = 1 << 20;

impl NetworkPlan {
    /// Checks `settings` (found at `field` in the file) for serving from `server`.
    pub fn new(settings: &Settings, server: Ipv4Addr, field: &str) -> Result<Self, FieldError> {
        if settings.mode == DhcpMode::Full && settings.subnets.is_empty() {
            return Err(FieldError::new(
                format!("{field}.subnets"),
                "full mode needs at least one subnet with a pool",
            ));
        }
        if settings.lease_time < Duration::from_secs(60) {
            return Err(FieldError::new(format!("{field}.lease_time"), "must be at least 1m"));
        }
        let mut subnets: Vec<SubnetPlan> = Vec::new();
        let mut total = 0u64;
        for (i, s) in settings.subnets.iter().enumerate() {
            let at = format!("{field}.subnets[{i}]");
            if let Some(other) = subnets.iter().find(|o| {
                o.subnet.contains(s.subnet.network()) || s.subnet.contains(o.subnet.network())
            }) {
                return Err(FieldError::new(
                    format!("{at}.subnet"),
                    format!("{} overlaps {}", s.subnet, other.subnet),
                ));
            }
            for (j, pool) in s.pools.iter().enumerate() {
                let at = format!("{at}.pools[{j}]");
                if !s.subnet.is_host(pool.first()) || !s.subnet.is_host(pool.last()) {
                    return Err(FieldError::new(
                        at,
                        format!("{pool} is not inside the host addresses of {}", s.subnet),
                    ));
                }
                if let Some(k) = s.pools[..j].iter().position(|p| p.overlaps(pool)) {
                    return Err(FieldError::new(at, format!("{pool} overlaps pools[{k}]")));
                }
                if pool.contains(server) {
                    return Err(FieldError::new(
                        at,
                        format!("{pool} contains the server's own address {server}"),
                    ));
                }
                total += pool.size();
            }
            if settings.mode == DhcpMode::Full && s.pools.is_empty() {
                return Err(FieldError::new(format!("{at}.pools"), "full mode needs a pool"));
            }
            if let Some(router) = s.router
                && !s.subnet.is_host(router)
            {
                return Err(FieldError::new(
                    format!("{at}.router"),
                    format!("{router} is not a host address of {}", s.subnet),
                ));
            }
            if let Some(domain) = &s.domain
                && !is_domain_name(domain)
            {
                return Err(FieldError::new(
                    format!("{at}.domain"),
                    format!("{domain:?} is not a domain name"),
                ));
            }
            let lease_time = s.lease_time.unwrap_or(settings.lease_time);
            if lease_time < Duration::from_secs(60) {
                return Err(FieldError::new(format!("{at}.lease_time"), "must be at least 1m"));
            }
            subnets.push(SubnetPlan {
                subnet: s.subnet,
                pools: s.pools.clone(),
                router: s.router,
                dns: s.dns.clone(),
                domain: s.domain.clone(),
                lease_time,
            });
        }
        if total > MAX_POOL_ADDRESSES {
            return Err(FieldError::new(
                format!("{field}.subnets"),
                format!("pools hold {total} addresses; at most {MAX_POOL_ADDRESSES} are supported"),
            ));
        }
        for (i, r) in settings.reservations.iter().enumerate() {
            let at = format!("{field}.reservations[{i}]");
            if !subnets.iter().any(|s| s.subnet.is_host(r.address)) {
                return Err(FieldError::new(
                    format!("{at}.address"),
                    format!("{} is not a host address of any configured subnet", r.address),
                ));
            }
            if r.address == server {
                return Err(FieldError::new(
                    format!("{at}.address"),
                    "is the server's own address",
                ));
            }
            if let Some(j) = settings.reservations[..i].iter().position(|o| o.mac == r.mac) {
                return Err(FieldError::new(
                    format!("{at}.mac"),
                    format!("{} is already reserved in reservations[{j}]", r.mac),
                ));
            }
            if let Some(j) = settings.reservations[..i].iter().position(|o| o.address == r.address)
            {
                return Err(FieldError::new(
                    format!("{at}.address"),
                    format!("{} is already reserved in reservations[{j}]", r.address),
                ));
            }
            if let Some(h) = &r.hostname
                && !is_domain_name(h)
            {
                return Err(FieldError::new(
                    format!("{at}.hostname"),
                    format!("{h:?} is not a valid host name"),
                ));
            }
        }
        for (i, relay) in settings.trusted_relays.iter().enumerate() {
            let at = format!("{field}.trusted_relays[{i}]");
            let not_an_address =
                |a: &Ipv4Addr| a.is_unspecified() || a.is_broadcast() || a.is_multicast();
            if not_an_address(&relay.giaddr) {
                return Err(FieldError::new(
                    at,
                    format!("{} is not a relay's address", relay.giaddr),
                ));
            }
            if let Some((j, source)) =
                relay.sources.iter().enumerate().find(|(_, a)| not_an_address(a))
            {
                return Err(FieldError::new(
                    format!("{at}.sources[{j}]"),
                    format!("{source} is not a relay's address"),
                ));
            }
            if let Some(j) =
                settings.trusted_relays[..i].iter().position(|o| o.giaddr == relay.giaddr)
            {
                return Err(FieldError::new(
                    at,
                    format!("{} is already trusted_relays[{j}]", relay.giaddr),
                ));
            }
            let relay = relay.giaddr;
            if settings.mode == DhcpMode::Full && !subnets.iter().any(|s| s.subnet.is_host(relay)) {
                return Err(FieldError::new(
                    at,
                    format!(
                        "{relay} is a host address of no configured subnet: its clients would get no address"
                    ),
                ));
            }
        }
        let local = subnets.iter().position(|s| s.subnet.contains(server));
        if settings.mode == DhcpMode::Full && local.is_none() {
            tracing::warn!(
                %server,
                "no configured subnet contains the server address: only relayed clients will get leases"
            );
        }
        Ok(Self {
            subnets,
            reservations: settings.reservations.clone(),
            trusted_relays: settings.trusted_relays.clone(),
            trust_relayed_leases: settings.trust_relayed_leases,
            local,
            decline_quarantine: settings.decline_quarantine,
        })
    }

    /// Whether a message that names `giaddr` as its relay and came from `source` is
    /// answered: sent directly (no relay), or by a trusted relay from one of its sources.
    pub fn check_relay(&self, giaddr: Ipv4Addr, source: Ipv4Addr) -> Result<(), RelayRefusal> {
        if giaddr.is_unspecified() {
            return Ok(());
        }
        match self.trusted_relays.iter().find(|r| r.giaddr == giaddr) {
            None => Err(RelayRefusal::UntrustedRelay),
            Some(relay) if !relay.sources.contains(&source) => Err(RelayRefusal::UnexpectedSource),
            Some(_) => Ok(()),
        }
    }

    /// The subnet a request belongs to: the relay's (`giaddr`) or the local one.
    pub fn subnet_for(&self, giaddr: Ipv4Addr) -> Option<usize> {
        if giaddr.is_unspecified() {
            self.local
        } else {
            self.subnets.iter().position(|s| s.subnet.contains(giaddr))
        }
    }

    /// Whether `addr` is in the subnet siteboot serves directly: its clients are on the link
    /// (one handed out through a relay is in the relay's subnet).
    pub fn on_link(&self, addr: Ipv4Addr) -> bool {
        self.local.is_some_and(|i| self.subnets[i].subnet.contains(addr))
    }

    pub fn reservation_for(&self, mac: MacAddr) -> Option<&Reservation> {
        self.reservations.iter().find(|r| r.mac == mac)
    }
}

/// RFC 1123 host/domain names: labels of letters, digits and hyphens, dot-separated.
fn is_domain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.trim_end_matches('.').split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subnet(cidr: &str, pools: &[&str]) -> SubnetSettings {
        SubnetSettings {
            subnet: cidr.parse().unwrap(),
            pools: pools.iter().map(|p| p.parse().unwrap()).collect(),
            router: None,
            dns: vec![],
            domain: None,
            lease_time: None,
        }
    }

    #[test]
    fn subnet_parsing() {
        let s: Ipv4Subnet = "10.99.0.0/24".parse().unwrap();
        assert_eq!(s.mask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(s.broadcast(), Ipv4Addr::new(10, 99, 0, 255));
        assert!(s.is_host("10.99.0.1".parse().unwrap()));
        assert!(!s.is_host("10.99.0.0".parse().unwrap()));
        assert!("10.99.0.1/24".parse::<Ipv4Subnet>().unwrap_err().contains("host bits"));
        assert!("10.99.0.0/33".parse::<Ipv4Subnet>().is_err());
        assert!("10.99.0.0".parse::<Ipv4Subnet>().is_err());
        assert_eq!("0.0.0.0/0".parse::<Ipv4Subnet>().unwrap().mask(), Ipv4Addr::UNSPECIFIED);
    }

    #[test]
    fn range_parsing() {
        let r: AddrRange = "10.0.0.10-10.0.0.20".parse().unwrap();
        assert_eq!(r.size(), 11);
        assert_eq!("10.0.0.5".parse::<AddrRange>().unwrap().size(), 1);
        assert!("10.0.0.20-10.0.0.10".parse::<AddrRange>().is_err());
    }

    #[test]
    fn plan_errors_name_the_field() {
        let server: Ipv4Addr = "10.0.0.1".parse().unwrap();
        let mut s = Settings::default();
        assert_eq!(NetworkPlan::new(&s, server, "dhcp").unwrap_err().field, "dhcp.subnets");

        s.subnets = vec![subnet("10.0.0.0/24", &["10.0.1.10-10.0.1.20"])];
        assert_eq!(
            NetworkPlan::new(&s, server, "dhcp").unwrap_err().field,
            "dhcp.subnets[0].pools[0]"
        );

        s.subnets = vec![subnet("10.0.0.0/24", &["10.0.0.10-10.0.0.20", "10.0.0.15-10.0.0.30"])];
        let e = NetworkPlan::new(&s, server, "dhcp").unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.message.contains("overlaps pools[0]")),
            ("dhcp.subnets[0].pools[1]", true)
        );

        s.subnets = vec![subnet("10.0.0.0/24", &["10.0.0.1-10.0.0.20"])];
        assert!(
            NetworkPlan::new(&s, server, "dhcp")
                .unwrap_err()
                .message
                .contains("server's own address")
        );

        s.subnets =
            vec![subnet("10.0.0.0/24", &["10.0.0.10-10.0.0.20"]), subnet("10.0.0.0/16", &[])];
        assert_eq!(
            NetworkPlan::new(&s, server, "dhcp").unwrap_err().field,
            "dhcp.subnets[1].subnet"
        );

        s.subnets = vec![subnet("10.0.0.0/24", &["10.0.0.10-10.0.0.20"])];
        let mac: MacAddr = "52:54:00:00:00:01".parse().unwrap();
        s.reservations = vec![
            Reservation { mac, address: "10.0.0.5".parse().unwrap(), hostname: Some("a".into()) },
            Reservation { mac, address: "10.0.0.6".parse().unwrap(), hostname: None },
        ];
        assert_eq!(
            NetworkPlan::new(&s, server, "dhcp").unwrap_err().field,
            "dhcp.reservations[1].mac"
        );
        s.reservations.truncate(1);
        s.reservations[0].hostname = Some("bad name".into());
        assert_eq!(
            NetworkPlan::new(&s, server, "dhcp").unwrap_err().field,
            "dhcp.reservations[0].hostname"
        );
        s.reservations[0].hostname = None;
        s.reservations[0].address = "10.1.0.5".parse().unwrap();
        assert_eq!(
            NetworkPlan::new(&s, server, "dhcp").unwrap_err().field,
            "dhcp.reservations[0].address"
        );
        s.reservations.clear();

        let relay = |a: &str| TrustedRelay::at(a.parse().unwrap());
        s.trusted_relays = vec![relay("10.0.0.254"), relay("10.5.0.1")];
        let e = NetworkPlan::new(&s, server, "dhcp").unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.message.contains("no configured subnet")),
            ("dhcp.trusted_relays[1]", true)
        );
        s.trusted_relays[1] = relay("0.0.0.0");
        assert_eq!(
            NetworkPlan::new(&s, server, "dhcp").unwrap_err().field,
            "dhcp.trusted_relays[1]"
        );
        s.trusted_relays[1] = relay("10.0.0.254");
        let e = NetworkPlan::new(&s, server, "dhcp").unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.message.contains("already trusted_relays[0]")),
            ("dhcp.trusted_relays[1]", true)
        );
        s.trusted_relays[1] = TrustedRelay {
            giaddr: "10.0.0.253".parse().unwrap(),
            sources: vec!["10.0.0.2".parse().unwrap(), Ipv4Addr::BROADCAST],
        };
        assert_eq!(
            NetworkPlan::new(&s, server, "dhcp").unwrap_err().field,
            "dhcp.trusted_relays[1].sources[1]"
        );
        s.trusted_relays[1].sources.pop();

        let plan = NetworkPlan::new(&s, server, "dhcp").unwrap();
        let check = |giaddr: &str, source: &str| {
            plan.check_relay(giaddr.parse().unwrap(), source.parse().unwrap())
        };
        assert_eq!(check("0.0.0.0", "10.0.0.77"), Ok(()), "not relayed");
        assert_eq!(check("10.0.0.254", "10.0.0.254"), Ok(()), "the short form: from giaddr");
        assert_eq!(check("10.0.0.253", "10.0.0.2"), Ok(()), "from a listed source");
        assert_eq!(check("10.0.0.252", "10.0.0.252"), Err(RelayRefusal::UntrustedRelay));
        // A trusted giaddr from anywhere else: a machine on the link posing as the relay.
        for (giaddr, source) in [("10.0.0.254", "10.0.0.77"), ("10.0.0.253", "10.0.0.253")] {
            assert_eq!(check(giaddr, source), Err(RelayRefusal::UnexpectedSource), "{giaddr}");
        }
        assert_eq!(plan.local, Some(0));
        assert_eq!(plan.subnet_for(Ipv4Addr::UNSPECIFIED), Some(0));
        assert_eq!(plan.subnet_for("10.0.0.254".parse().unwrap()), Some(0));
        assert_eq!(plan.subnet_for("10.5.0.1".parse().unwrap()), None);
    }

    #[test]
    fn trusted_relays_are_an_address_or_giaddr_with_sources() {
        let read = |relays: &str| {
            serde_json::from_str::<Settings>(&format!(r#"{{"trusted_relays": {relays}}}"#))
                .map(|s| s.trusted_relays)
        };
        let ip = |a: &str| a.parse::<Ipv4Addr>().unwrap();
        let relays = read(
            r#"["10.0.5.1", {"giaddr": "10.0.6.1"}, {"giaddr": "10.0.7.1", "sources": ["10.0.0.2", "10.0.0.3"]}]"#,
        )
        .unwrap();
        assert_eq!(
            relays,
            [
                TrustedRelay::at(ip("10.0.5.1")),
                TrustedRelay::at(ip("10.0.6.1")),
                TrustedRelay {
                    giaddr: ip("10.0.7.1"),
                    sources: vec![ip("10.0.0.2"), ip("10.0.0.3")]
                },
            ]
        );
        for bad in [
            r#"[{"giaddr": "10.0.7.1", "sources": []}]"#,
            r#"[{"giaddr": "10.0.7.1", "source": "10.0.0.2"}]"#,
            r#"["relay.example"]"#,
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
    }
}
