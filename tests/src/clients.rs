//! Real DHCP peers in network namespaces: the clients busybox `udhcpc`, ISC `dhclient` and Kea's
//! `perfdhcp`, and `dnsmasq` as a site's existing DHCP server (or as a reference server for
//! checking the harness itself). Each client runs in its own namespace ([`ClientHost`]) on a veth
//! joined to the server's bridge, so its unicast renewals and releases leave by its own interface.
//! [`ThreadDhcp`] is a minimal client without a process, for the simulated hosts.

use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable};

use crate::netns::Netns;
use crate::process::Supervised;

const UDHCPC_SCRIPT: &str = include_str!("../fixtures/dhcp/udhcpc.script");
const DHCLIENT_SCRIPT: &str = include_str!("../fixtures/dhcp/dhclient.script");
const DHCLIENT_CONF: &str = include_str!("../fixtures/dhcp/dhclient.conf");

/// A lease event as a client's script saw it (`bound`, `renew`, `deconfig` for udhcpc; `BOUND`,
/// `REBOOT`, `RENEW`, `RELEASE`, ... for dhclient).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lease {
    pub event: String,
    pub address: Option<Ipv4Addr>,
    pub prefix_len: Option<u8>,
    pub routers: Vec<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
    pub lease_secs: Option<u64>,
    pub server: Option<Ipv4Addr>,
    pub domain: Option<String>,
}

impl Lease {
    /// Parses one line written by the fixture scripts: tab-separated `key=value` fields.
    fn parse(line: &str) -> Self {
        let mut lease = Lease::default();
        for (key, value) in line.split('\t').filter_map(|field| field.split_once('=')) {
            let value = value.trim();
            let addrs = || value.split_whitespace().filter_map(|a| a.parse().ok()).collect();
            match key {
                "event" => lease.event = value.to_owned(),
                "ip" => lease.address = value.parse().ok(),
                "mask" => lease.prefix_len = prefix_len(value),
                "router" => lease.routers = addrs(),
                "dns" => lease.dns = addrs(),
                "lease" => lease.lease_secs = value.parse().ok(),
                "server" => lease.server = value.parse().ok(),
                "domain" if !value.is_empty() => lease.domain = Some(value.to_owned()),
                _ => {}
            }
        }
        lease
    }
}

/// `24` (udhcpc) or `255.255.255.0` (dhclient) -> 24.
fn prefix_len(mask: &str) -> Option<u8> {
    match mask.parse::<Ipv4Addr>() {
        Ok(mask) => Some(u32::from(mask).count_ones() as u8),
        Err(_) => mask.parse().ok(),
    }
}

/// A namespace with one interface `eth0` (with a chosen MAC) on the server's bridge: one DHCP
/// client machine.
pub struct ClientHost {
    pub mac: String,
    dir: tempfile::TempDir,
    // Last: processes started in it are dropped (killed) by their owners first.
    pub ns: Netns,
}

impl ClientHost {
    pub const IFACE: &str = "eth0";

    /// Creates the namespace and joins its `eth0` to `bridge` in `server`.
    pub fn attach(server: &Netns, bridge: &str, mac: &str) -> Result<Self> {
        let ns = Netns::new("cli")?;
        server.connect(bridge, &ns, Self::IFACE, Some(mac))?;
        let dir = tempfile::Builder::new().prefix("siteboot-client-").tempdir()?;
        Ok(Self { mac: mac.to_owned(), dir, ns })
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Writes a fixture script into `dir` with its events file filled in; returns both paths.
fn write_script(dir: &Path, name: &str, template: &str) -> Result<(PathBuf, PathBuf)> {
    let events = dir.join(format!("{name}.events"));
    let script = dir.join(format!("{name}.script"));
    std::fs::write(&script, template.replace("@EVENTS@", &events.to_string_lossy()))?;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    Ok((script, events))
}

fn read_events(path: &Path) -> Vec<Lease> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(Lease::parse).collect()
}

/// Waits for an event after the first `skip` that satisfies `want`.
fn wait_event(
    what: &str,
    events: &Path,
    skip: usize,
    timeout: Duration,
    want: impl Fn(&Lease) -> bool,
) -> Result<Lease> {
    crate::wait::until(what, timeout, Duration::from_millis(50), || {
        read_events(events).into_iter().skip(skip).find(&want)
    })
}

/// busybox `udhcpc` running in the foreground: it keeps its lease, renews on SIGUSR1 and
/// releases on SIGUSR2.
pub struct Udhcpc {
    events: PathBuf,
    process: Supervised,
    // Its own directory, so it may outlive the ClientHost value it was started from.
    _dir: tempfile::TempDir,
}

impl Udhcpc {
    /// Starts udhcpc on the host's `eth0`; `extra` are more udhcpc arguments (e.g. `-r ADDR`
    /// to ask for an address). It retries until it gets a lease.
    pub fn start(host: &ClientHost, extra: &[&str]) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("siteboot-udhcpc-").tempdir()?;
        let (script, events) = write_script(dir.path(), "udhcpc", UDHCPC_SCRIPT)?;
        let mut command = host.ns.command("udhcpc");
        command
            .args(["-f", "-i", ClientHost::IFACE, "-t", "4", "-T", "1", "-A", "1", "-s"])
            .arg(&script)
            .args(extra);
        let name = format!("udhcpc-{}", host.mac);
        let process = Supervised::spawn(&name, &mut command, dir.path())?;
        Ok(Self { events, process, _dir: dir })
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<Lease> {
        read_events(&self.events)
    }

    /// Waits for the first lease (`bound`).
    pub fn wait_bound(&mut self, timeout: Duration) -> Result<Lease> {
        self.check_running()?;
        wait_event("udhcpc to get a lease", &self.events, 0, timeout, |l| l.event == "bound")
    }

    /// Renews now (SIGUSR1: a unicast REQUEST to the server) and waits for the `renew` event.
    pub fn renew(&mut self, timeout: Duration) -> Result<Lease> {
        self.check_running()?;
        let seen = self.events().len();
        self.process.signal(libc::SIGUSR1);
        wait_event("udhcpc to renew", &self.events, seen, timeout, |l| {
            l.event == "renew" || l.event == "bound"
        })
    }

    /// Releases now (SIGUSR2: a RELEASE to the server) and waits for the `deconfig` event.
    pub fn release(&mut self, timeout: Duration) -> Result<()> {
        self.check_running()?;
        let seen = self.events().len();
        self.process.signal(libc::SIGUSR2);
        wait_event("udhcpc to release", &self.events, seen, timeout, |l| l.event == "deconfig")
            .map(drop)
    }

    /// Stops udhcpc without releasing (as if the machine lost power).
    pub fn kill(&mut self) {
        self.process.kill9();
    }

    fn check_running(&mut self) -> Result<()> {
        match self.process.try_wait() {
            None => Ok(()),
            Some(status) => bail!("udhcpc exited ({status}):\n{}", self.process.log_tail()),
        }
    }
}

/// A DHCP client that runs on the calling thread, which must be in the client's namespace
/// ([`Netns::enter_current_thread`]): DISCOVER, OFFER, REQUEST and ACK over a UDP socket bound
/// to `iface`, then the leased address and mask put on `iface`, as udhcpc's `bound` script
/// does. It starts no process, so a thousand simulated hosts can boot at once. It neither
/// renews nor releases: the lease must outlast the caller's use of the address.
pub struct ThreadDhcp<'a> {
    pub iface: &'a str,
    /// The client's hardware address (`chaddr`), `52:54:00:...`.
    pub mac: &'a str,
}

impl ThreadDhcp<'_> {
    const CLIENT_PORT: u16 = 68;
    const SERVER_PORT: u16 = 67;
    /// How long to wait for an answer before sending again (udhcpc's `-T 1`).
    const RETRY: Duration = Duration::from_secs(1);

    /// Gets a lease and configures it; gives up after `timeout` or when `interrupted` says so.
    pub fn obtain(&self, timeout: Duration, interrupted: impl Fn() -> bool) -> Result<Lease> {
        let chaddr = self.mac.parse::<siteboot_boot::MacAddr>()?.octets();
        let socket = self.socket()?;
        // One transaction id for every retry, so a late answer to an earlier try still counts.
        let xid: u32 = u32::from_be_bytes([chaddr[2], chaddr[3], chaddr[4], chaddr[5]])
            ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if interrupted() {
                bail!("interrupted while getting a lease");
            }
            if std::time::Instant::now() >= deadline {
                bail!("no DHCP lease for {} within {timeout:?}", self.mac);
            }
            let discover = request(xid, &chaddr, MessageType::Discover);
            send(&socket, &discover)?;
            let Some(offer) = receive(&socket, xid, &chaddr, &[MessageType::Offer])? else {
                continue;
            };
            let mut ask = request(xid, &chaddr, MessageType::Request);
            ask.opts_mut().insert(DhcpOption::RequestedIpAddress(offer.yiaddr()));
            if let Some(server) = offer.opts().get(OptionCode::ServerIdentifier) {
                ask.opts_mut().insert(server.clone());
            }
            send(&socket, &ask)?;
            let answers = [MessageType::Ack, MessageType::Nak];
            match receive(&socket, xid, &chaddr, &answers)? {
                Some(ack) if ack.opts().has_msg_type(MessageType::Ack) => {
                    let lease = lease_of(&ack);
                    let address = lease.address.context("an ACK without an address")?;
                    set_address(self.iface, address, lease.prefix_len.unwrap_or(24))?;
                    return Ok(lease);
                }
                // A NAK, or no answer: start over, as a client does.
                _ => {}
            }
        }
    }

    fn socket(&self) -> Result<std::net::UdpSocket> {
        use socket2::{Domain, Protocol, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
        socket.set_broadcast(true)?;
        socket.bind_device(Some(self.iface.as_bytes()))?;
        // A socket on this port closed a moment ago (an earlier lease on this interface) may
        // still be held by a child another thread of the test forked and has not exec'd yet:
        // close-on-exec lets go of it only at the exec. Wait that out, briefly.
        let address = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, Self::CLIENT_PORT).into();
        let deadline = std::time::Instant::now() + Self::RETRY;
        loop {
            match socket.bind(&address) {
                Ok(()) => break,
                Err(e)
                    if e.kind() == ErrorKind::AddrInUse && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("binding port {} on {}", Self::CLIENT_PORT, self.iface)
                    });
                }
            }
        }
        socket.set_read_timeout(Some(Self::RETRY))?;
        // The server answers from an address this interface has no route to yet, which
        // reverse-path filtering (inherited from the machine's sysctl) would drop; udhcpc reads
        // a raw socket and never meets the filter. The kernel takes the larger of the two.
        for conf in ["all", self.iface] {
            std::fs::write(format!("/proc/sys/net/ipv4/conf/{conf}/rp_filter"), "0")
                .with_context(|| format!("turning off rp_filter for {conf}"))?;
        }
        Ok(socket.into())
    }
}

/// DHCP messages with any `chaddr`, from a machine on the segment that forges nothing else
/// (its Ethernet and IP sources are its own): what the DECLINE and RELEASE attacks send. The
/// socket is made in the machine's namespace and used from the test thread.
pub struct ForgedDhcp {
    socket: std::net::UdpSocket,
    server: Ipv4Addr,
}

impl ForgedDhcp {
    /// Port 68 on `iface` of `ns`; RELEASEs go to `server`.
    pub fn open(ns: &Netns, iface: &'static str, server: Ipv4Addr) -> Result<Self> {
        let socket = ns.enter(move || ThreadDhcp { iface, mac: "" }.socket())?;
        Ok(Self { socket, server })
    }

    /// DISCOVER, then REQUEST what was offered, as `mac`: the address ACKed, or `None` if no
    /// OFFER or ACK came within a second (the address is not put on any interface).
    pub fn lease(&self, mac: &str) -> Result<Option<Ipv4Addr>> {
        let chaddr = mac.parse::<siteboot_boot::MacAddr>()?.octets();
        let xid = u32::from_be_bytes([chaddr[2], chaddr[3], chaddr[4], chaddr[5]]).rotate_left(7);
        send(&self.socket, &request(xid, &chaddr, MessageType::Discover))?;
        let Some(offer) = receive(&self.socket, xid, &chaddr, &[MessageType::Offer])? else {
            return Ok(None);
        };
        let mut ask = request(xid, &chaddr, MessageType::Request);
        ask.opts_mut().insert(DhcpOption::RequestedIpAddress(offer.yiaddr()));
        ask.opts_mut().insert(DhcpOption::ServerIdentifier(self.server));
        send(&self.socket, &ask)?;
        let answers = [MessageType::Ack, MessageType::Nak];
        Ok(receive(&self.socket, xid, &chaddr, &answers)?
            .filter(|m| m.opts().has_msg_type(MessageType::Ack))
            .map(|ack| ack.yiaddr()))
    }

    /// A DECLINE of `addr` as `mac`, broadcast as a client with no address sends it.
    pub fn decline(&self, mac: &str, addr: Ipv4Addr) -> Result<()> {
        let chaddr = mac.parse::<siteboot_boot::MacAddr>()?.octets();
        let mut decline = request(1, &chaddr, MessageType::Decline);
        decline.opts_mut().insert(DhcpOption::RequestedIpAddress(addr));
        decline.opts_mut().insert(DhcpOption::ServerIdentifier(self.server));
        send(&self.socket, &decline)
    }

    /// A RELEASE of `addr` (in `ciaddr`) as `mac`, unicast to the server from this machine's
    /// own address, as a client releases.
    pub fn release(&self, mac: &str, addr: Ipv4Addr) -> Result<()> {
        let chaddr = mac.parse::<siteboot_boot::MacAddr>()?.octets();
        let mut release = request(2, &chaddr, MessageType::Release);
        release.set_ciaddr(addr).set_flags(Flags::default());
        release.opts_mut().insert(DhcpOption::ServerIdentifier(self.server));
        let bytes = release.to_vec()?;
        self.socket.send_to(&bytes, SocketAddrV4::new(self.server, ThreadDhcp::SERVER_PORT))?;
        Ok(())
    }
}

/// A machine on the segment posing as a DHCP relay: it sends relayed DISCOVERs (`giaddr` set)
/// unicast to the server from its own address, and has the relay's address too, so the
/// server's answer to `giaddr`:67 reaches it.
pub struct ForgedRelay {
    socket: std::net::UdpSocket,
    server: Ipv4Addr,
    giaddr: Ipv4Addr,
}

impl ForgedRelay {
    /// Puts `source` (first, so datagrams leave from it) and `giaddr` on `iface` of `ns`, and
    /// binds port 67 there.
    pub fn open(
        ns: &Netns,
        iface: &'static str,
        source: Ipv4Addr,
        giaddr: Ipv4Addr,
        server: Ipv4Addr,
    ) -> Result<Self> {
        let mut addresses = vec![source, giaddr];
        addresses.dedup();
        for address in addresses {
            ns.ip(&["addr", "add", &format!("{address}/24"), "dev", iface])?;
        }
        let socket = ns.enter(move || {
            use socket2::{Domain, Protocol, Socket, Type};
            let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
            socket.bind_device(Some(iface.as_bytes()))?;
            socket
                .bind(&SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, ThreadDhcp::SERVER_PORT).into())?;
            socket.set_read_timeout(Some(ThreadDhcp::RETRY))?;
            Ok(std::net::UdpSocket::from(socket))
        })?;
        Ok(Self { socket, server, giaddr })
    }

    /// A DISCOVER as `mac`, relayed through `giaddr` with `relay_info` as option 82 (RFC
    /// 3046 sub-options, already encoded): the OFFER if one came within a second.
    pub fn discover(&self, mac: &str, relay_info: Option<&[u8]>) -> Result<Option<Message>> {
        let chaddr = mac.parse::<siteboot_boot::MacAddr>()?.octets();
        let xid = u32::from_be_bytes([chaddr[2], chaddr[3], chaddr[4], chaddr[5]]).rotate_left(11);
        let mut discover = request(xid, &chaddr, MessageType::Discover);
        discover.set_giaddr(self.giaddr).set_hops(1);
        let mut bytes = discover.to_vec()?;
        if let Some(info) = relay_info {
            // dhcproto's option 82 type re-encodes sub-options; a relay appends its bytes last.
            let end = bytes.iter().rposition(|b| *b == 255).context("no end option")?;
            bytes.truncate(end);
            bytes.extend_from_slice(&[82, u8::try_from(info.len())?]);
            bytes.extend_from_slice(info);
            bytes.push(255);
        }
        self.socket.send_to(&bytes, SocketAddrV4::new(self.server, ThreadDhcp::SERVER_PORT))?;
        receive(&self.socket, xid, &chaddr, &[MessageType::Offer])
    }
}

/// A client's DISCOVER or REQUEST, broadcast, asking for what udhcpc asks for.
fn request(xid: u32, chaddr: &[u8], kind: MessageType) -> Message {
    let unspecified = Ipv4Addr::UNSPECIFIED;
    let mut message =
        Message::new_with_id(xid, unspecified, unspecified, unspecified, unspecified, chaddr);
    message.set_flags(Flags::default().set_broadcast());
    let opts = message.opts_mut();
    opts.insert(DhcpOption::MessageType(kind));
    opts.insert(DhcpOption::ClientIdentifier([&[1], chaddr].concat()));
    opts.insert(DhcpOption::ParameterRequestList(vec![
        OptionCode::SubnetMask,
        OptionCode::Router,
        OptionCode::DomainNameServer,
        OptionCode::DomainName,
        OptionCode::AddressLeaseTime,
    ]));
    message
}

fn send(socket: &std::net::UdpSocket, message: &Message) -> Result<()> {
    let bytes = message.to_vec()?;
    socket.send_to(&bytes, SocketAddrV4::new(Ipv4Addr::BROADCAST, ThreadDhcp::SERVER_PORT))?;
    Ok(())
}

/// The server's answer to transaction `xid` if one of the `wanted` kinds comes within the
/// socket's read timeout; other datagrams (other clients' broadcast answers) are skipped.
fn receive(
    socket: &std::net::UdpSocket,
    xid: u32,
    chaddr: &[u8],
    wanted: &[MessageType],
) -> Result<Option<Message>> {
    let until = std::time::Instant::now() + ThreadDhcp::RETRY;
    let mut buffer = [0u8; 1500];
    while std::time::Instant::now() < until {
        let n = match socket.recv(&mut buffer) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Ok(None);
            }
            Err(e) => return Err(e).context("receiving a DHCP answer"),
        };
        let Ok(message) = Message::decode(&mut Decoder::new(&buffer[..n])) else { continue };
        let ours = message.opcode() == Opcode::BootReply
            && message.xid() == xid
            && message.chaddr().get(..chaddr.len()) == Some(chaddr);
        if ours && message.opts().msg_type().is_some_and(|t| wanted.contains(&t)) {
            return Ok(Some(message));
        }
    }
    Ok(None)
}

/// An ACK as the fixture scripts record a `bound` event.
fn lease_of(ack: &Message) -> Lease {
    let opts = ack.opts();
    let mut lease =
        Lease { event: "bound".to_owned(), address: Some(ack.yiaddr()), ..Lease::default() };
    if let Some(DhcpOption::SubnetMask(mask)) = opts.get(OptionCode::SubnetMask) {
        lease.prefix_len = Some(u32::from(*mask).count_ones() as u8);
    }
    if let Some(DhcpOption::Router(routers)) = opts.get(OptionCode::Router) {
        lease.routers = routers.clone();
    }
    if let Some(DhcpOption::DomainNameServer(dns)) = opts.get(OptionCode::DomainNameServer) {
        lease.dns = dns.clone();
    }
    if let Some(DhcpOption::AddressLeaseTime(secs)) = opts.get(OptionCode::AddressLeaseTime) {
        lease.lease_secs = Some(u64::from(*secs));
    }
    if let Some(DhcpOption::ServerIdentifier(server)) = opts.get(OptionCode::ServerIdentifier) {
        lease.server = Some(*server);
    }
    if let Some(DhcpOption::DomainName(domain)) = opts.get(OptionCode::DomainName) {
        lease.domain = Some(domain.clone());
    }
    lease
}

/// Takes every IPv4 address off `iface` (in the calling thread's namespace), as a NIC has none
/// at power-on: SIOCSIFADDR to 0.0.0.0, what `ifconfig IFACE 0.0.0.0` does.
pub fn clear_address(iface: &str) -> Result<()> {
    interface_ioctl(iface, libc::SIOCSIFADDR, Ipv4Addr::UNSPECIFIED)
}

/// Puts `address/prefix_len` on `iface` in the calling thread's namespace, in place of the
/// address it had, with ifconfig's two ioctls rather than an `ip` process.
fn set_address(iface: &str, address: Ipv4Addr, prefix_len: u8) -> Result<()> {
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix_len)).unwrap_or(0);
    interface_ioctl(iface, libc::SIOCSIFADDR, address)?;
    interface_ioctl(iface, libc::SIOCSIFNETMASK, Ipv4Addr::from(mask))
}

/// An `ifreq` ioctl that takes an IPv4 address (SIOCSIFADDR, SIOCSIFNETMASK).
fn interface_ioctl(iface: &str, request: libc::c_ulong, address: Ipv4Addr) -> Result<()> {
    if iface.len() >= libc::IFNAMSIZ {
        bail!("interface name too long: {iface}");
    }
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    // SAFETY: ifreq is plain data, valid all zero.
    let mut ifreq: libc::ifreq = unsafe { std::mem::zeroed() };
    for (to, from) in ifreq.ifr_name.iter_mut().zip(iface.bytes()) {
        *to = from as libc::c_char;
    }
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(address).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes; the kernel reads it as sockaddr_in.
    ifreq.ifr_ifru.ifru_addr =
        unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) };
    // SAFETY: the request takes a pointer to an ifreq, which outlives the call.
    if unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&socket), request as _, &mut ifreq) }
        != 0
    {
        bail!("ioctl {request:#x} {address} on {iface}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// ISC `dhclient` with its own lease file, pid file, config and script. `obtain` runs
/// `dhclient -1`, which returns once bound and leaves a daemon holding the lease; `obtain` again
/// after [`Dhclient::stop`] does an INIT-REBOOT (REQUEST for the address in the lease file).
pub struct Dhclient<'h> {
    host: &'h ClientHost,
    script: PathBuf,
    events: PathBuf,
    conf: PathBuf,
    lease_file: PathBuf,
    pid_file: PathBuf,
    runs: u32,
}

impl<'h> Dhclient<'h> {
    pub fn new(host: &'h ClientHost) -> Result<Self> {
        let (script, events) = write_script(host.dir(), "dhclient", DHCLIENT_SCRIPT)?;
        let conf = host.dir().join("dhclient.conf");
        std::fs::write(&conf, DHCLIENT_CONF)?;
        Ok(Self {
            host,
            script,
            events,
            conf,
            lease_file: host.dir().join("dhclient.leases"),
            pid_file: host.dir().join("dhclient.pid"),
            runs: 0,
        })
    }

    pub fn events(&self) -> Vec<Lease> {
        read_events(&self.events)
    }

    /// The client's own lease file (ISC format).
    pub fn lease_file(&self) -> String {
        std::fs::read_to_string(&self.lease_file).unwrap_or_default()
    }

    /// Gets (or re-confirms) a lease and returns the event that bound it.
    pub fn obtain(&mut self, timeout: Duration) -> Result<Lease> {
        let seen = self.events().len();
        self.run(&["-1"], timeout)?;
        wait_event("dhclient to bind", &self.events, seen, Duration::from_secs(5), |l| {
            matches!(l.event.as_str(), "BOUND" | "REBOOT" | "RENEW" | "REBIND")
        })
    }

    /// Sends a RELEASE for the current lease and stops the daemon (`dhclient -r`).
    pub fn release(&mut self, timeout: Duration) -> Result<()> {
        self.run(&["-r"], timeout)
    }

    /// Stops the daemon without releasing (`dhclient -x`).
    pub fn stop(&mut self, timeout: Duration) -> Result<()> {
        self.run(&["-x"], timeout)
    }

    fn run(&mut self, mode: &[&str], timeout: Duration) -> Result<()> {
        self.runs += 1;
        let mut command = self.host.ns.command("dhclient");
        command
            .arg("-4")
            .args(mode)
            .arg("-v")
            .arg("-cf")
            .arg(&self.conf)
            .arg("-lf")
            .arg(&self.lease_file)
            .arg("-pf")
            .arg(&self.pid_file)
            .arg("-sf")
            .arg(&self.script)
            .arg(ClientHost::IFACE);
        let name = format!("dhclient-{}", self.runs);
        let mut process = Supervised::spawn(&name, &mut command, self.host.dir())?;
        let status = process.wait_timeout(timeout)?;
        if !status.success() {
            bail!("dhclient {} failed ({status}):\n{}", mode.join(" "), process.log_tail());
        }
        Ok(())
    }
}

impl Drop for Dhclient<'_> {
    fn drop(&mut self) {
        // The daemon outlives `dhclient -1`; end it (no release: the namespace goes away). The
        // name check keeps a stale pid file from killing an unrelated process.
        let pid = std::fs::read_to_string(&self.pid_file).ok().and_then(|p| p.trim().parse().ok());
        let comm =
            |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if let Some(pid) = pid
            && comm(pid).trim() == "dhclient"
        {
            // SAFETY: kill(2) on the pid the daemon wrote for itself.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// One exchange's counters from perfdhcp's summary (`DISCOVER-OFFER`, `REQUEST-ACK`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exchange {
    pub name: String,
    pub sent: u64,
    pub received: u64,
    pub drops: u64,
    pub orphans: u64,
    pub rejected_leases: u64,
    pub non_unique_addresses: u64,
    /// Each answered packet's delay (sent to received) in ms, when perfdhcp ran with `-x t`.
    pub delays_ms: Vec<f64>,
}

#[derive(Clone, Debug)]
pub struct PerfdhcpReport {
    pub exchanges: Vec<Exchange>,
    pub output: String,
}

impl PerfdhcpReport {
    pub fn exchange(&self, name: &str) -> Option<&Exchange> {
        self.exchanges.iter().find(|e| e.name == name)
    }

    /// Reads perfdhcp's printed summary.
    pub fn parse(output: &str) -> Self {
        let mut exchanges: Vec<Exchange> = Vec::new();
        // With `-x t`, a "Timestamps for packets" section per exchange follows the summaries.
        let mut timestamps_of: Option<usize> = None;
        for line in output.lines().map(str::trim) {
            if let Some(name) =
                line.strip_prefix("***Statistics for: ").and_then(|rest| rest.strip_suffix("***"))
            {
                exchanges.push(Exchange { name: name.to_owned(), ..Exchange::default() });
                timestamps_of = None;
                continue;
            }
            if let Some(name) = line
                .strip_prefix("***Timestamps for packets: ")
                .and_then(|rest| rest.strip_suffix("***"))
            {
                timestamps_of = exchanges.iter().position(|e| e.name == name);
                continue;
            }
            if let Some(index) = timestamps_of {
                // "sent / received: 000000.040174 / 000000.040424" (seconds)
                if let Some((sent, received)) = line
                    .strip_prefix("sent / received:")
                    .and_then(|times| times.split_once('/'))
                    .and_then(|(s, r)| {
                        Some((s.trim().parse::<f64>().ok()?, r.trim().parse::<f64>().ok()?))
                    })
                {
                    exchanges[index].delays_ms.push((received - sent) * 1000.0);
                }
                continue;
            }
            let (Some(exchange), Some((key, value))) = (exchanges.last_mut(), line.split_once(':'))
            else {
                continue;
            };
            let Ok(value) = value.trim().parse::<u64>() else {
                continue;
            };
            match key {
                "sent packets" => exchange.sent = value,
                "received packets" => exchange.received = value,
                "drops" => exchange.drops = value,
                "orphans" => exchange.orphans = value,
                "rejected leases" => exchange.rejected_leases = value,
                "non unique addresses" => exchange.non_unique_addresses = value,
                _ => {}
            }
        }
        Self { exchanges, output: output.to_owned() }
    }
}

/// Runs `perfdhcp -4` from the host's `eth0` for `seconds` at `rate` exchanges/s with `clients`
/// simulated clients. perfdhcp needs an address on its interface: `address` (CIDR) is added.
pub fn perfdhcp(
    host: &ClientHost,
    address: &str,
    rate: u32,
    clients: u32,
    seconds: u32,
) -> Result<PerfdhcpReport> {
    perfdhcp_with(host, address, rate, clients, seconds, &[])
}

/// [`perfdhcp`] with more perfdhcp arguments (`-u`: count an address given to two clients).
pub fn perfdhcp_with(
    host: &ClientHost,
    address: &str,
    rate: u32,
    clients: u32,
    seconds: u32,
    extra: &[&str],
) -> Result<PerfdhcpReport> {
    host.ns.ip(&["addr", "add", address, "dev", ClientHost::IFACE])?;
    let mut command = host.ns.command("perfdhcp");
    command.args(["-4", "-l", ClientHost::IFACE]).args(extra).args([
        "-r",
        &rate.to_string(),
        "-R",
        &clients.to_string(),
        "-p",
        &seconds.to_string(),
    ]);
    let mut process = Supervised::spawn("perfdhcp", &mut command, host.dir())?;
    let status = process.wait_timeout(Duration::from_secs(u64::from(seconds) + 30))?;
    let report = PerfdhcpReport::parse(&process.log());
    // perfdhcp exits 3 when packets were dropped; the caller judges the counters.
    if report.exchanges.is_empty() {
        bail!("perfdhcp ({status}) printed no statistics:\n{}", process.log_tail());
    }
    Ok(report)
}

/// dnsmasq as a DHCP (and optionally TFTP) server on `iface`; DNS off. Logs every DHCP packet.
pub struct Dnsmasq {
    leases: PathBuf,
    process: Supervised,
    _dir: tempfile::TempDir,
}

impl Dnsmasq {
    /// Starts dnsmasq in `ns` with the base options plus `options` (e.g.
    /// `--dhcp-range=10.99.0.100,10.99.0.199,255.255.255.0,1h`).
    pub fn start(ns: &Netns, iface: &str, options: &[String]) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("siteboot-dnsmasq-").tempdir()?;
        let leases = dir.path().join("leases");
        let mut command = ns.command("dnsmasq");
        command
            .args(["--keep-in-foreground", "--conf-file=/dev/null", "--port=0", "--user=root"])
            .args(["--bind-interfaces", "--log-facility=-", "--log-dhcp", "--no-ping"])
            .arg(format!("--interface={iface}"))
            .arg(format!("--dhcp-leasefile={}", leases.display()))
            .arg(format!("--pid-file={}", dir.path().join("pid").display()))
            .args(options);
        let mut process = Supervised::spawn("dnsmasq", &mut command, dir.path())?;
        crate::wait::for_("dnsmasq to start", Duration::from_secs(10), || {
            process.log().contains("started, version").then_some(())
        })
        .with_context(|| process.log_tail())?;
        if let Some(status) = process.try_wait() {
            bail!("dnsmasq exited ({status}):\n{}", process.log_tail());
        }
        Ok(Self { leases, process, _dir: dir })
    }

    pub fn log(&self) -> String {
        self.process.log()
    }

    /// The lease file: `expiry mac address hostname client-id` per line.
    pub fn leases(&self) -> String {
        std::fs::read_to_string(&self.leases).unwrap_or_default()
    }
}

/// `tcpdump` on an interface of a namespace, keeping every DHCPACK a server sent: who was given
/// which address, whichever replica sent it.
pub struct AckCapture {
    process: Supervised,
    _dir: tempfile::TempDir,
}

impl AckCapture {
    /// Starts capturing server-to-client DHCP on `iface` in `ns`; returns once tcpdump listens.
    pub fn start(ns: &Netns, iface: &str) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("siteboot-capture-").tempdir()?;
        let process = tcpdump(ns, &dir, &["-i", iface, "-n", "-l", "-vv", "udp src port 67"])?;
        Ok(Self { process, _dir: dir })
    }

    /// Every DHCPACK so far, as (client MAC, address), in order.
    pub fn acks(&self) -> Vec<(String, Ipv4Addr)> {
        parse_acks(&self.process.log())
    }
}

/// `tcpdump` writing the packets on an interface of a namespace that match a filter to a file,
/// to search them for what must never cross the wire in clear.
pub struct PacketCapture {
    /// tcpdump, stopped when the capture is dropped.
    _process: Supervised,
    file: PathBuf,
    _dir: tempfile::TempDir,
}

impl PacketCapture {
    /// Starts capturing what `filter` (pcap syntax) matches on `iface` in `ns`; returns once
    /// tcpdump listens.
    pub fn start(ns: &Netns, iface: &str, filter: &str) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("siteboot-capture-").tempdir()?;
        let file = dir.path().join("capture.pcap");
        let path = file.to_str().context("a UTF-8 temporary path")?;
        let process = tcpdump(ns, &dir, &["-i", iface, "-n", "-U", "-s", "0", "-w", path, filter])?;
        Ok(Self { _process: process, file, _dir: dir })
    }

    /// Every byte captured so far, packet headers included.
    pub fn bytes(&self) -> Result<Vec<u8>> {
        Ok(std::fs::read(&self.file)?)
    }
}

/// `tcpdump args` in `ns`, its output logged in `dir`; returns once it listens.
fn tcpdump(ns: &Netns, dir: &tempfile::TempDir, args: &[&str]) -> Result<Supervised> {
    let process = Supervised::spawn("tcpdump", ns.command("tcpdump").args(args), dir.path())?;
    crate::wait::until(
        "tcpdump to listen",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || process.log().contains("listening on").then_some(()),
    )?;
    Ok(process)
}

/// Reads tcpdump's verbose BOOTP output: a packet starts on an unindented line; an ACK has a
/// `DHCP-Message (53), length 1: ACK` line, its `Your-IP` and its `Client-Ethernet-Address`.
fn parse_acks(text: &str) -> Vec<(String, Ipv4Addr)> {
    let mut acks = Vec::new();
    let mut packet: Vec<&str> = Vec::new();
    let mut flush = |packet: &mut Vec<&str>| {
        let field = |name: &str| {
            packet.iter().find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().to_owned()))
        };
        let is_ack =
            packet.iter().any(|l| l.trim().starts_with("DHCP-Message") && l.ends_with(": ACK"));
        if is_ack
            && let (Some(mac), Some(address)) = (field("Client-Ethernet-Address"), field("Your-IP"))
            && let (Some(mac), Ok(address)) = (mac.split_whitespace().next(), address.parse())
        {
            acks.push((mac.to_owned(), address));
        }
        packet.clear();
    };
    for line in text.lines() {
        if !line.starts_with([' ', '\t']) {
            flush(&mut packet);
        }
        packet.push(line);
    }
    flush(&mut packet);
    acks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_script_lines() {
        let lease = Lease::parse(
            "event=bound\tip=10.99.0.100\tmask=24\trouter=10.99.0.1\tdns=10.99.0.1 10.99.0.2\tlease=3600\tserver=10.99.0.1\tdomain=lab.internal",
        );
        assert_eq!(lease.event, "bound");
        assert_eq!(lease.address, Some(Ipv4Addr::new(10, 99, 0, 100)));
        assert_eq!(lease.prefix_len, Some(24));
        assert_eq!(lease.dns.len(), 2);
        assert_eq!(lease.lease_secs, Some(3600));
        assert_eq!(lease.domain.as_deref(), Some("lab.internal"));
        assert_eq!(Lease::parse("event=BOUND\tmask=255.255.255.0").prefix_len, Some(24));
    }

    #[test]
    fn perfdhcp_counters_and_per_packet_delays() {
        let output = "\
***Statistics for: DISCOVER-OFFER***
sent packets: 3
received packets: 2
drops: 1
min delay: 0.210 ms
***Statistics for: REQUEST-ACK***
sent packets: 2
received packets: 2
drops: 0

***Timestamps for packets: DISCOVER-OFFER***
sent / received: 000000.000146 / 000000.000492
sent / received: 000001.040174 / 000001.042174
***Timestamps for packets: REQUEST-ACK***
sent / received: 000000.500000 / 000000.503000
sent / received: 000001.500000 / 000001.500500
";
        let report = PerfdhcpReport::parse(output);
        let offer = report.exchange("DISCOVER-OFFER").unwrap();
        assert_eq!((offer.sent, offer.received, offer.drops), (3, 2, 1));
        let round = |v: &[f64]| v.iter().map(|d| (d * 1000.0).round() / 1000.0).collect::<Vec<_>>();
        assert_eq!(round(&offer.delays_ms), vec![0.346, 2.0]);
        let ack = report.exchange("REQUEST-ACK").unwrap();
        assert_eq!((ack.sent, ack.received, ack.drops), (2, 2, 0));
        assert_eq!(round(&ack.delays_ms), vec![3.0, 0.5]);
    }

    #[test]
    fn acks_are_read_from_tcpdump_s_verbose_output() {
        let text = "\
10:00:00.1 IP (tos 0x10, ttl 128, id 0, offset 0, flags [none], proto UDP (17), length 328)
    10.99.0.1.67 > 255.255.255.255.68: [udp sum ok] BOOTP/DHCP, Reply, length 300, xid 0x1
\t  Your-IP 10.99.0.100
\t  Client-Ethernet-Address 52:54:00:00:0f:01
\t  Vendor-rfc1048 Extensions
\t    DHCP-Message (53), length 1: Offer
10:00:00.2 IP (tos 0x10, ttl 128, id 0, offset 0, flags [none], proto UDP (17), length 328)
    10.99.0.1.67 > 255.255.255.255.68: [udp sum ok] BOOTP/DHCP, Reply, length 300, xid 0x1
\t  Your-IP 10.99.0.100
\t  Client-Ethernet-Address 52:54:00:00:0f:01 (oui Unknown)
\t  Vendor-rfc1048 Extensions
\t    DHCP-Message (53), length 1: ACK
";
        assert_eq!(
            parse_acks(text),
            vec![("52:54:00:00:0f:01".to_owned(), "10.99.0.100".parse().unwrap())]
        );
    }
}
