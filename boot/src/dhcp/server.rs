//! DHCP protocol handling, with no I/O: a datagram and the time go in, a reply and a lease
//! record to make durable come out. The socket loop (`socket.rs`) does the rest.
//!
//! Full mode follows RFC 2131 (DISCOVER/OFFER/REQUEST/ACK/NAK, DECLINE, RELEASE, INFORM, renew
//! and rebind); proxy mode answers PXE clients with boot information only, on port 67 and on
//! the PXE boot-server port 4011 (where UEFI clients ask after a proxy offer without option 43).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};
use siteboot_ipxe::IpxeBinaries;

use super::budget::{DECLINES_PER_CLIENT, DeclineBudget};
use super::leases::{DeclineRefused, Lease, LeaseRecord, LeaseTable, SharedLeases, UnixTime};
use super::relay::{RefusalLog, RefusedPins, RefusedRelays};
use super::relay_agent::{RelayAgentInfo, RelayPin};
use super::settings::SubnetPlan;
use crate::client::{BootClient, HTTP_CLIENT, PXE_CLIENT};
use crate::decision::{self, Answer, BootOffer, DhcpMode};
use crate::inventory::Inventory;
use crate::metrics::{Metrics, RelayRefusal};
use crate::timeline::{Stage, Timeline};
use crate::{Endpoints, MacAddr};

pub const SERVER_PORT: u16 = 67;
pub const CLIENT_PORT: u16 = 68;
pub const PXE_PORT: u16 = 4011;

/// How long an OFFER holds its address for the client's REQUEST.
const OFFER_HOLD_SECS: u64 = 30;
/// BOOTP's minimum message size: some PXE ROMs drop shorter replies.
const MIN_REPLY_LEN: usize = 300;
const MAGIC_COOKIE: [u8; 4] = [99, 130, 83, 99];

/// The port a datagram arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    /// 67: DHCP (full or proxy).
    Dhcp,
    /// 4011: PXE boot server requests.
    Pxe,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub bytes: Vec<u8>,
    pub to: SocketAddrV4,
}

/// What handling one datagram produced. `record` must be durable before `reply` is sent.
#[derive(Debug, Default)]
pub struct Outcome {
    pub reply: Option<Reply>,
    pub record: Option<LeaseRecord>,
}

/// What the server needs from the rest of the appliance.
#[derive(Clone)]
pub struct Context {
    pub mode: DhcpMode,
    pub endpoints: Endpoints,
    pub binaries: Arc<IpxeBinaries>,
    pub inventory: Arc<dyn Inventory>,
    pub timeline: Arc<Timeline>,
    pub metrics: Arc<Metrics>,
    /// Full mode: answer only MACs the inventory [knows](Inventory::knows).
    pub known_hosts_only: bool,
}

pub struct DhcpServer {
    ctx: Context,
    /// Shared with the neighbour view: the leases ACKed here are who holds which address.
    leases: SharedLeases,
    /// Locked for DECLINEs and refused RELEASEs only (taken after `leases`).
    declines: Mutex<DeclineBudget>,
    /// Locked for refused relayed messages only (taken after `leases`).
    refused_relays: Mutex<RefusedRelays>,
    /// Locked for relayed messages refused by their host's pin only (taken after `leases`).
    refused_pins: Mutex<RefusedPins>,
}

impl DhcpServer {
    pub fn new(ctx: Context, leases: SharedLeases) -> Self {
        Self {
            ctx,
            leases,
            declines: Mutex::new(DeclineBudget::new()),
            refused_relays: Mutex::new(RefusedRelays::new()),
            refused_pins: Mutex::new(RefusedPins::new()),
        }
    }

    pub fn table(&self) -> MutexGuard<'_, LeaseTable> {
        self.leases.lock().expect("lease table lock")
    }

    pub fn refresh_lease_gauge(&self, now: UnixTime) {
        let active = self.table().active(now) as u64;
        self.ctx.metrics.dhcp_leases.store(active, std::sync::atomic::Ordering::Relaxed);
    }

    /// Handles one datagram received on `port` from `from`.
    pub fn handle(&self, bytes: &[u8], from: SocketAddrV4, port: Port, now: UnixTime) -> Outcome {
        let Some((msg, relay_agent_information)) = decode(bytes) else {
            self.ctx.metrics.dhcp_dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(%from, len = bytes.len(), "dropping a datagram that is not a DHCP request");
            return Outcome::default();
        };
        let Some(client) = BootClient::from_message(&msg) else {
            self.ctx.metrics.dhcp_dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(%from, htype = ?msg.htype(), hlen = msg.hlen(), "dropping a request from a non-Ethernet client");
            return Outcome::default();
        };
        let msg_type = msg.opts().msg_type().expect("decode checked the message type");
        // Until the inventory has read its hosts, every host would look unknown: stay silent
        // (the client retries) rather than answer wrongly.
        if let Err(why) = self.ctx.inventory.ready() {
            self.ctx.metrics.dhcp_dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(%from, mac = %client.mac, why, "not answering yet: the inventory is not ready");
            return Outcome::default();
        }
        let mut table = self.table();
        if let Err(why) = table.plan().check_relay(msg.giaddr(), *from.ip()) {
            self.refuse_relayed(msg.giaddr(), from, why);
            return Outcome::default();
        }
        // A pinned host's relayed messages are answered only when their relay says where they
        // came in as the pin does; a lease granted so keeps it (`Lease::relay_agent`).
        let mut relay_agent = RelayAgentInfo::default();
        if !msg.giaddr().is_unspecified()
            && let Some(pin) = self.ctx.inventory.relay_pin(client.mac)
        {
            let said = relay_agent_information.as_deref().map(RelayAgentInfo::parse);
            let said = said.unwrap_or_default();
            if !pin.admits(&said) {
                self.refuse_unpinned(client.mac, msg.giaddr(), from, &pin, &said);
                return Outcome::default();
            }
            relay_agent = pin.as_info();
        }
        self.ctx.metrics.dhcp_received(msg_type);
        table.sweep(now);
        let mut outcome = match (self.ctx.mode, port) {
            (DhcpMode::Off, _) => Outcome::default(),
            (_, Port::Pxe) => self.boot_server(&msg, &client, from),
            (DhcpMode::Proxy, Port::Dhcp) => self.proxy(&msg, &client),
            (DhcpMode::Full, Port::Dhcp) => {
                self.full(&mut table, &msg, msg_type, &client, from, &relay_agent, now)
            }
        };
        if let Some(reply) = &mut outcome.reply {
            // RFC 3046 2.2: the relay agent information goes back verbatim; relays drop
            // replies without it.
            if let Some(value) = &relay_agent_information {
                append_option(&mut reply.bytes, RELAY_AGENT_INFORMATION, value);
            }
            if let Some(t) = decode_type(&reply.bytes) {
                self.ctx.metrics.dhcp_sent(t);
            }
        }
        outcome
    }

    /// Counts a relayed message that is not answered, and logs the first from each relay
    /// (its `giaddr` and source): an operator sees why that relay's hosts get nothing.
    fn refuse_relayed(&self, giaddr: Ipv4Addr, from: SocketAddrV4, why: RelayRefusal) {
        self.ctx.metrics.dhcp_dropped.fetch_add(1, Ordering::Relaxed);
        self.ctx.metrics.dhcp_relayed_dropped(why);
        let log =
            self.refused_relays.lock().expect("refused relays lock").refused((giaddr, *from.ip()));
        const COUNTED: &str =
            "logged once per relay and source; siteboot_dhcp_relayed_dropped_total counts them all";
        match (log, why) {
            (RefusalLog::First, RelayRefusal::UntrustedRelay) => {
                tracing::warn!(%giaddr, %from, "dropping messages relayed by {giaddr}, a relay not in dhcp.trusted_relays ({COUNTED})");
            }
            (RefusalLog::First, RelayRefusal::UnexpectedSource) => {
                tracing::warn!(%giaddr, %from, "dropping messages that name the trusted relay {giaddr} but come from {}, an address dhcp.trusted_relays does not list for it (a machine posing as the relay?) ({COUNTED})", from.ip());
            }
            (RefusalLog::LastLogged, _) => {
                tracing::warn!(%giaddr, %from, "dropping relayed messages from more relays than are logged: no more are logged; siteboot_dhcp_relayed_dropped_total counts them");
            }
            // Not the relay's refusal but a host's: logged per MAC by `refuse_unpinned`.
            (RefusalLog::First, RelayRefusal::RelayAgentMismatch) | (RefusalLog::Quiet, _) => {}
        }
    }

    /// Counts a relayed message for a pinned MAC whose relay said something else than the pin
    /// names (or nothing), and logs the first for each MAC, with both: either a machine on
    /// another port of the relay forges the host's MAC, or the pin is wrong.
    fn refuse_unpinned(
        &self,
        mac: MacAddr,
        giaddr: Ipv4Addr,
        from: SocketAddrV4,
        pin: &RelayPin,
        said: &RelayAgentInfo,
    ) {
        self.ctx.metrics.dhcp_dropped.fetch_add(1, Ordering::Relaxed);
        self.ctx.metrics.dhcp_relayed_dropped(RelayRefusal::RelayAgentMismatch);
        match self.refused_pins.lock().expect("refused pins lock").refused(mac) {
            RefusalLog::First => {
                tracing::warn!(%mac, %giaddr, %from, relay_agent = %said, %pin, "dropping relayed messages for {mac}: its relay {giaddr} said {said}, and the host is pinned to {pin} (a machine on another port of the relay forging its MAC, or a pin to correct?) (logged once per MAC; siteboot_dhcp_relayed_dropped_total counts them all)");
            }
            RefusalLog::LastLogged => {
                tracing::warn!(%mac, "dropping relayed messages for more pinned MACs than are logged: no more are logged; siteboot_dhcp_relayed_dropped_total counts them");
            }
            RefusalLog::Quiet => {}
        }
    }

    fn answer(&self, client: &BootClient) -> Answer {
        let known = self.ctx.inventory.boots(client.mac);
        decision::answer(self.ctx.mode, client, known, &self.ctx.binaries, &self.ctx.endpoints)
    }

    fn record(&self, mac: MacAddr, stage: Stage, detail: String) {
        self.ctx.timeline.record(mac, stage, detail);
    }

    // ----- full mode -----

    #[allow(clippy::too_many_arguments)]
    fn full(
        &self,
        table: &mut LeaseTable,
        msg: &Message,
        msg_type: MessageType,
        client: &BootClient,
        from: SocketAddrV4,
        relay_agent: &RelayAgentInfo,
        now: UnixTime,
    ) -> Outcome {
        let mac = client.mac;
        if self.ctx.known_hosts_only && !self.ctx.inventory.knows(mac) {
            self.ctx.metrics.dhcp_dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(%mac, "ignoring a MAC the inventory does not know (dhcp.known_hosts_only)");
            return Outcome::default();
        }
        let Some(subnet) = table.plan().subnet_for(msg.giaddr()) else {
            tracing::warn!(%mac, giaddr = %msg.giaddr(), "no configured subnet for this request; ignoring it");
            return Outcome::default();
        };
        match msg_type {
            MessageType::Discover => self.discover(table, msg, client, subnet, now),
            MessageType::Request => self.request(table, msg, client, subnet, relay_agent, now),
            MessageType::Decline => self.decline(table, msg, mac, now),
            MessageType::Release => self.release(table, msg, mac, from, now),
            MessageType::Inform => self.inform(table, msg, client, subnet),
            other => {
                tracing::debug!(%mac, message = ?other, "ignoring a message type servers do not answer");
                Outcome::default()
            }
        }
    }

    fn discover(
        &self,
        table: &mut LeaseTable,
        msg: &Message,
        client: &BootClient,
        subnet: usize,
        now: UnixTime,
    ) -> Outcome {
        let mac = client.mac;
        self.record(mac, Stage::DhcpDiscover, describe_client(client));
        let Some(addr) = table.choose(mac, subnet, requested_address(msg), now) else {
            tracing::warn!(%mac, subnet = %table.plan().subnets[subnet].subnet, "no free address to offer: the pool is exhausted");
            return Outcome::default();
        };
        table.offer(mac, addr, now + OFFER_HOLD_SECS);
        let answer = self.answer(client);
        let reply = self.lease_reply(table, msg, MessageType::Offer, addr, subnet, client, &answer);
        self.record(mac, Stage::DhcpOffer, format!("{addr} {}", describe_answer(&answer)));
        Outcome { reply: Some(reply), record: None }
    }

    /// `relay_agent`: for a pinned host's relayed message, what its relay said of the pinned
    /// sub-options, kept in the lease (it is identity only while the host's pin admits it).
    fn request(
        &self,
        table: &mut LeaseTable,
        msg: &Message,
        client: &BootClient,
        subnet: usize,
        relay_agent: &RelayAgentInfo,
        now: UnixTime,
    ) -> Outcome {
        let mac = client.mac;
        let server = self.ctx.endpoints.address;
        let server_id = server_identifier(msg);
        if server_id.is_some_and(|id| id != server) {
            // The client chose another server's offer.
            table.cancel_offer(mac);
            return Outcome::default();
        }
        // RFC 2131 4.3.2: SELECTING and INIT-REBOOT name the address in option 50; RENEWING and
        // REBINDING in ciaddr.
        let Some(addr) =
            requested_address(msg).or(Some(msg.ciaddr()).filter(|a| !a.is_unspecified()))
        else {
            return self.nak(msg, mac, "no requested address");
        };
        self.record(mac, Stage::DhcpRequest, format!("{addr}"));
        let plan = &table.plan().subnets[subnet];
        if !plan.subnet.is_host(addr) {
            return self.nak(msg, mac, &format!("{addr} is not on this network"));
        }
        if let Some(r) = table.plan().reservation_for(mac)
            && plan.subnet.contains(r.address)
            && r.address != addr
        {
            return self.nak(msg, mac, &format!("{mac} is reserved {}", r.address));
        }
        let reserved_for_mac = table.plan().reservation_for(mac).is_some_and(|r| r.address == addr);
        let ours = table.lease(addr).is_some_and(|l| l.mac == mac);
        if !(reserved_for_mac || ours || plan.in_pool(addr)) {
            return self.nak(msg, mac, &format!("{addr} is not in a pool"));
        }
        if !table.available_to(addr, mac, now) {
            return self.nak(msg, mac, &format!("{addr} belongs to another client"));
        }
        let lease_secs = plan.lease_time.as_secs();
        let hostname = table.plan().reservation_for(mac).and_then(|r| r.hostname.clone());
        let relay_agent = relay_agent.clone();
        let record =
            table.bind(Lease { addr, mac, expires: now + lease_secs, hostname, relay_agent });
        let answer = self.answer(client);
        let reply = self.lease_reply(table, msg, MessageType::Ack, addr, subnet, client, &answer);
        self.record(
            mac,
            Stage::DhcpAck,
            format!("{addr} for {lease_secs}s {}", describe_answer(&answer)),
        );
        Outcome { reply: Some(reply), record: Some(record) }
    }

    /// Whether DHCP must keep `mac`'s hold on `addr` whatever a DECLINE says: the
    /// address is reserved, or `mac` is one of the site's hosts (the inventory knows it). A
    /// host being provisioned has its ramdisk token bound to the address its lease holds, and
    /// a provisioned one its node address; and nothing in either message proves who sent it.
    fn protected(&self, table: &LeaseTable, mac: MacAddr, addr: Ipv4Addr) -> bool {
        table.is_reserved(addr)
            || table.plan().reservation_for(mac).is_some()
            || self.ctx.inventory.knows(mac)
    }

    /// Counts a DECLINE or RELEASE that changed nothing, and logs the first of each MAC's
    /// window (a flood of them costs a counter, not a log line or an allocation each).
    fn ignored(&self, mac: MacAddr, window: u64, now: UnixTime, why: Ignored) {
        let counter = match why {
            Ignored::ReleaseFromElsewhere { .. } => &self.ctx.metrics.dhcp_releases_ignored,
            _ => &self.ctx.metrics.dhcp_declines_ignored,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut budget = self.declines.lock().expect("decline budget lock");
        if budget.log_refusal(mac, now, window) {
            tracing::warn!(%mac, window_secs = window, "{why} (logged once per MAC per window; siteboot_dhcp_declines_ignored_total and siteboot_dhcp_releases_ignored_total count them all)");
        }
    }

    /// RFC 2131 4.3.3: a client that found its address in use (ARP) declines it, and the
    /// server "MUST mark the network address as not available". A DECLINE comes from
    /// 0.0.0.0 with nothing but `chaddr` to say who sent it, so honouring every one let a
    /// single MAC quarantine the whole pool (REQUEST, DECLINE, repeat) and let anyone take a
    /// host's address away. The choice here (Kea quarantines for its
    /// `decline-probation-period` with no limit; dnsmasq drops the lease and disables a
    /// static address for 10 minutes; ISC dhcpd offers `deny declines` to ignore them all):
    ///
    /// - a known host's or reserved address is never quarantined: the lease stays (a real
    ///   conflict there is the operator's to fix; the warning says so);
    /// - any other MAC quarantines at most [`DECLINES_PER_CLIENT`] addresses per window (the
    ///   quarantine's length);
    /// - all together quarantine at most half of a subnet's pool (the table's reserve).
    ///
    /// Past a limit the DECLINE changes nothing, is counted, and is logged once per MAC per
    /// window.
    fn decline(
        &self,
        table: &mut LeaseTable,
        msg: &Message,
        mac: MacAddr,
        now: UnixTime,
    ) -> Outcome {
        let Some(addr) = requested_address(msg) else {
            return Outcome::default();
        };
        if server_identifier(msg) != Some(self.ctx.endpoints.address) {
            return Outcome::default();
        }
        if !table.holds(mac, addr) {
            tracing::debug!(%mac, %addr, "ignoring a DECLINE of an address this MAC does not hold");
            return Outcome::default();
        }
        let window = budget_window(table);
        if self.protected(table, mac, addr) {
            self.ignored(mac, window, now, Ignored::Protected(addr));
            return Outcome::default();
        }
        if !self.declines.lock().expect("decline budget lock").allows(mac, now, window) {
            self.ignored(mac, window, now, Ignored::OverBudget(addr));
            return Outcome::default();
        }
        let until = now + table.plan().decline_quarantine.as_secs();
        match table.decline(mac, addr, until) {
            Ok(record) => {
                self.declines.lock().expect("decline budget lock").spend(mac, now, window);
                tracing::warn!(%mac, %addr, "client declined the address (in use by someone else?); quarantined");
                self.record(mac, Stage::DhcpDecline, format!("{addr} quarantined"));
                Outcome { reply: None, record: Some(record) }
            }
            Err(DeclineRefused::NotHeld) => Outcome::default(),
            Err(DeclineRefused::Reserved) => {
                self.ignored(mac, window, now, Ignored::Reserved(addr));
                Outcome::default()
            }
            Err(DeclineRefused::ReserveReached) => {
                self.ignored(mac, window, now, Ignored::ReserveReached(addr));
                Outcome::default()
            }
        }
    }

    /// RFC 2131 4.4.6: a client gives its lease back with a RELEASE unicast from its address,
    /// `ciaddr` = that address. Honoured only when the datagram comes from `ciaddr` itself,
    /// not relayed (a relay forwards broadcasts; a RELEASE is unicast): a RELEASE forged with a
    /// host's `chaddr` from anywhere else cannot end the lease its token is bound to. One that
    /// also forges the host's address as its source still can (the kernel's ARP entry then
    /// names the forger, so the identity it would take is refused, not gained).
    fn release(
        &self,
        table: &mut LeaseTable,
        msg: &Message,
        mac: MacAddr,
        from: SocketAddrV4,
        now: UnixTime,
    ) -> Outcome {
        if server_identifier(msg).is_some_and(|id| id != self.ctx.endpoints.address) {
            return Outcome::default();
        }
        let addr = msg.ciaddr();
        if !table.lease(addr).is_some_and(|l| l.mac == mac && l.expires > now) {
            return Outcome::default();
        }
        let window = budget_window(table);
        if *from.ip() != addr || !msg.giaddr().is_unspecified() {
            self.ignored(mac, window, now, Ignored::ReleaseFromElsewhere { addr, from });
            return Outcome::default();
        }
        let record = table.release(mac, addr, now);
        if record.is_some() {
            self.record(mac, Stage::DhcpRelease, format!("{addr}"));
        }
        Outcome { reply: None, record }
    }

    fn inform(
        &self,
        table: &LeaseTable,
        msg: &Message,
        client: &BootClient,
        subnet: usize,
    ) -> Outcome {
        let mut reply = base_reply(msg, MessageType::Ack, self.ctx.endpoints.address);
        add_network_options(&mut reply, &table.plan().subnets[subnet], None);
        if let Answer::Boot(offer) = self.answer(client) {
            add_boot_options(&mut reply, &offer, client, self.ctx.endpoints.address);
        }
        let to = destination(msg, MessageType::Ack);
        Outcome { reply: Some(Reply { bytes: encode(&reply), to }), record: None }
    }

    #[allow(clippy::too_many_arguments)]
    fn lease_reply(
        &self,
        table: &LeaseTable,
        msg: &Message,
        t: MessageType,
        addr: Ipv4Addr,
        subnet: usize,
        client: &BootClient,
        answer: &Answer,
    ) -> Reply {
        let server = self.ctx.endpoints.address;
        let plan = &table.plan().subnets[subnet];
        let mut reply = base_reply(msg, t, server);
        reply.set_yiaddr(addr);
        let hostname = table.plan().reservation_for(client.mac).and_then(|r| r.hostname.as_deref());
        add_network_options(&mut reply, plan, hostname);
        let secs = u32::try_from(plan.lease_time.as_secs()).unwrap_or(u32::MAX);
        let opts = reply.opts_mut();
        opts.insert(DhcpOption::AddressLeaseTime(secs));
        opts.insert(DhcpOption::Renewal(secs / 2));
        opts.insert(DhcpOption::Rebinding(secs / 8 * 7));
        if let Answer::Boot(offer) = answer {
            add_boot_options(&mut reply, offer, client, server);
        }
        Reply { bytes: encode(&reply), to: destination(msg, t) }
    }

    fn nak(&self, msg: &Message, mac: MacAddr, why: &str) -> Outcome {
        let mut reply = base_reply(msg, MessageType::Nak, self.ctx.endpoints.address);
        reply.opts_mut().insert(DhcpOption::Message(why.to_owned()));
        if !msg.giaddr().is_unspecified() {
            // RFC 2131 4.3.2: a relay must broadcast the NAK to the client.
            reply.set_flags(Flags::default().set_broadcast());
        }
        self.record(mac, Stage::DhcpNak, why.to_owned());
        let to = destination(msg, MessageType::Nak);
        Outcome { reply: Some(Reply { bytes: encode(&reply), to }), record: None }
    }

    // ----- proxy mode and the PXE boot server -----

    /// Port 67 in proxy mode: boot information for PXE clients' DISCOVERs; the site's DHCP
    /// server does the rest.
    fn proxy(&self, msg: &Message, client: &BootClient) -> Outcome {
        if msg.opts().msg_type() != Some(MessageType::Discover) {
            return Outcome::default();
        }
        let Answer::Boot(offer) = self.answer(client) else {
            return Outcome::default();
        };
        self.record(client.mac, Stage::DhcpDiscover, describe_client(client));
        let reply = self.boot_only_reply(msg, MessageType::Offer, &offer, client);
        self.record(client.mac, Stage::ProxyOffer, offer.boot_file().to_owned());
        let to = destination(msg, MessageType::Offer);
        Outcome { reply: Some(Reply { bytes: encode(&reply), to }), record: None }
    }

    /// Port 4011: a PXE client asking the boot server directly (unicast, it has an address).
    /// Boot information only: nothing here says who holds `from` (anyone can send this).
    fn boot_server(&self, msg: &Message, client: &BootClient, from: SocketAddrV4) -> Outcome {
        if !matches!(msg.opts().msg_type(), Some(MessageType::Request | MessageType::Inform)) {
            return Outcome::default();
        }
        // The boot decision is the proxy one whatever the mode: only boot information here.
        let known = self.ctx.inventory.boots(client.mac);
        let answer = decision::answer(
            DhcpMode::Proxy,
            client,
            known,
            &self.ctx.binaries,
            &self.ctx.endpoints,
        );
        let Answer::Boot(offer) = answer else {
            return Outcome::default();
        };
        let mut reply = self.boot_only_reply(msg, MessageType::Ack, &offer, client);
        reply.set_ciaddr(msg.ciaddr());
        self.record(client.mac, Stage::ProxyAck, offer.boot_file().to_owned());
        Outcome { reply: Some(Reply { bytes: encode(&reply), to: from }), record: None }
    }

    fn boot_only_reply(
        &self,
        msg: &Message,
        t: MessageType,
        offer: &BootOffer,
        client: &BootClient,
    ) -> Message {
        let server = self.ctx.endpoints.address;
        let mut reply = base_reply(msg, t, server);
        add_boot_options(&mut reply, offer, client, server);
        // PXE spec: the client machine identifier (GUID) is echoed.
        if let Some(DhcpOption::ClientMachineIdentifier(id)) =
            msg.opts().get(OptionCode::ClientMachineIdentifier)
        {
            reply.opts_mut().insert(DhcpOption::ClientMachineIdentifier(id.clone()));
        }
        reply
    }
}

/// Options read from requests. dhcproto's decoders for some other options panic on malformed
/// lengths (debug assertions, an unwrap), so everything else is dropped before decoding.
const OPTIONS_READ: [u8; 12] = [12, 50, 53, 54, 55, 57, 60, 61, 77, 93, 97, 175];
/// The relay agent information option (RFC 3046), kept as bytes: never decoded by dhcproto
/// (its sub-option decoder is one of those), echoed as received.
const RELAY_AGENT_INFORMATION: u8 = 82;
/// Where the options start: after the fixed BOOTP header and the magic cookie.
const OPTIONS_OFFSET: usize = 240;

/// Decodes a BOOTREQUEST with the DHCP magic cookie and a message type; anything else is not
/// for us. With it, a relayed message's relay agent information option value, as received
/// (dhcproto re-encodes sub-options, and encodes an unknown option 82 twice).
fn decode(bytes: &[u8]) -> Option<(Message, Option<Vec<u8>>)> {
    if bytes.get(236..OPTIONS_OFFSET) != Some(&MAGIC_COOKIE[..]) {
        return None;
    }
    let (clean, relay_agent_information) = keep_read_options(bytes)?;
    let msg = Message::decode(&mut Decoder::new(&clean)).ok()?;
    // Not relayed: a client's own option 82 vouches for nothing and is not echoed.
    let relay_agent_information =
        relay_agent_information.filter(|_| !msg.giaddr().is_unspecified());
    (msg.opcode() == Opcode::BootRequest && msg.opts().msg_type().is_some())
        .then_some((msg, relay_agent_information))
}

/// A copy of the message holding only the options in [`OPTIONS_READ`], and the value of its
/// relay agent information option (RFC 3396: the concatenation, if split); `None` if the
/// options area is malformed (an option runs past the end).
fn keep_read_options(bytes: &[u8]) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
    let mut clean = bytes[..OPTIONS_OFFSET].to_vec();
    let mut relay_agent_information: Option<Vec<u8>> = None;
    let mut rest = &bytes[OPTIONS_OFFSET..];
    while let Some((&code, tail)) = rest.split_first() {
        match code {
            0 => rest = tail,
            255 => break,
            _ => {
                let (&len, tail) = tail.split_first()?;
                let value = tail.get(..len as usize)?;
                if OPTIONS_READ.contains(&code) {
                    clean.extend_from_slice(&[code, len]);
                    clean.extend_from_slice(value);
                } else if code == RELAY_AGENT_INFORMATION {
                    relay_agent_information.get_or_insert_default().extend_from_slice(value);
                }
                rest = &tail[len as usize..];
            }
        }
    }
    clean.push(255);
    Some((clean, relay_agent_information))
}

/// The message type of a reply this server encoded (read as requests are: the option 82 it
/// echoes came from the network).
fn decode_type(bytes: &[u8]) -> Option<MessageType> {
    let (clean, _) = keep_read_options(bytes)?;
    Message::decode(&mut Decoder::new(&clean)).ok()?.opts().msg_type()
}

/// Adds option `code` with `value` (split in 255-byte parts, RFC 3396) last in an encoded
/// reply, before its end option, keeping the reply at least [`MIN_REPLY_LEN`] long.
fn append_option(reply: &mut Vec<u8>, code: u8, value: &[u8]) {
    let mut end = OPTIONS_OFFSET;
    while let Some(&at) = reply.get(end) {
        match at {
            255 => break,
            0 => end += 1,
            _ => end += 2 + usize::from(reply.get(end + 1).copied().unwrap_or(0)),
        }
    }
    reply.truncate(end);
    for part in value.chunks(255) {
        reply.extend_from_slice(&[code, part.len() as u8]);
        reply.extend_from_slice(part);
    }
    reply.push(255);
    if reply.len() < MIN_REPLY_LEN {
        reply.resize(MIN_REPLY_LEN, 0);
    }
}

fn encode(msg: &Message) -> Vec<u8> {
    let mut buf = Vec::with_capacity(MIN_REPLY_LEN);
    msg.encode(&mut Encoder::new(&mut buf)).expect("encoding into a Vec cannot fail");
    if buf.len() < MIN_REPLY_LEN {
        buf.resize(MIN_REPLY_LEN, 0);
    }
    buf
}

/// Why a DECLINE or RELEASE changed nothing.
#[derive(Debug, Clone, Copy)]
enum Ignored {
    /// A DECLINE of a known host's or a reserved address.
    Protected(Ipv4Addr),
    /// A DECLINE from a MAC that had its budget's addresses quarantined in this window.
    OverBudget(Ipv4Addr),
    /// A DECLINE of a reserved address.
    Reserved(Ipv4Addr),
    /// A DECLINE when half of the subnet's pool is quarantined.
    ReserveReached(Ipv4Addr),
    /// A RELEASE sent from another address than the one released, or relayed.
    ReleaseFromElsewhere { addr: Ipv4Addr, from: SocketAddrV4 },
}

impl std::fmt::Display for Ignored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Protected(addr) => write!(
                f,
                "a DECLINE of {addr}, a known host's or reserved address, was not honoured: the host keeps its lease (if another machine really uses {addr}, take that machine off it)"
            ),
            Self::OverBudget(addr) => write!(
                f,
                "a DECLINE of {addr} was not honoured: this MAC had {DECLINES_PER_CLIENT} addresses quarantined in this window already"
            ),
            Self::Reserved(addr) => {
                write!(f, "a DECLINE of {addr} was not honoured: the address is reserved")
            }
            Self::ReserveReached(addr) => write!(
                f,
                "a DECLINE of {addr} was not honoured: half of the pool is quarantined already"
            ),
            Self::ReleaseFromElsewhere { addr, from } => write!(
                f,
                "a RELEASE of {addr} sent from {from} was not honoured: a client releases the address it sends from"
            ),
        }
    }
}

/// The window of the per-MAC DECLINE budget: the quarantine's length, so one MAC never has
/// more than [`DECLINES_PER_CLIENT`] addresses in quarantine at once.
fn budget_window(table: &LeaseTable) -> u64 {
    table.plan().decline_quarantine.as_secs().max(1)
}

fn requested_address(msg: &Message) -> Option<Ipv4Addr> {
    match msg.opts().get(OptionCode::RequestedIpAddress) {
        Some(DhcpOption::RequestedIpAddress(a)) if !a.is_unspecified() => Some(*a),
        _ => None,
    }
}

fn server_identifier(msg: &Message) -> Option<Ipv4Addr> {
    match msg.opts().get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(a)) => Some(*a),
        _ => None,
    }
}

/// A reply with the request's identity fields copied, the type and our server id.
fn base_reply(msg: &Message, t: MessageType, server: Ipv4Addr) -> Message {
    let mut reply = Message::default();
    reply
        .set_opcode(Opcode::BootReply)
        .set_htype(msg.htype())
        .set_xid(msg.xid())
        .set_flags(msg.flags())
        .set_giaddr(msg.giaddr())
        .set_chaddr(msg.chaddr());
    reply.opts_mut().insert(DhcpOption::MessageType(t));
    reply.opts_mut().insert(DhcpOption::ServerIdentifier(server));
    reply
}

fn add_network_options(reply: &mut Message, plan: &SubnetPlan, hostname: Option<&str>) {
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::SubnetMask(plan.subnet.mask()));
    opts.insert(DhcpOption::BroadcastAddr(plan.subnet.broadcast()));
    if let Some(router) = plan.router {
        opts.insert(DhcpOption::Router(vec![router]));
    }
    if !plan.dns.is_empty() {
        opts.insert(DhcpOption::DomainNameServer(plan.dns.clone()));
    }
    if let Some(domain) = &plan.domain {
        opts.insert(DhcpOption::DomainName(domain.clone()));
    }
    if let Some(name) = hostname {
        opts.insert(DhcpOption::Hostname(name.to_owned()));
    }
}

fn add_boot_options(reply: &mut Message, offer: &BootOffer, client: &BootClient, server: Ipv4Addr) {
    let file = offer.boot_file();
    // The `file` field holds 127 bytes and a NUL; longer names go only in option 67.
    if file.len() < 128 {
        reply.set_fname_str(file);
    }
    reply.opts_mut().insert(DhcpOption::BootfileName(file.as_bytes().to_vec()));
    // next-server: iPXE accepts a proxyDHCP answer only with both siaddr and a file name.
    reply.set_siaddr(server);
    match offer {
        BootOffer::Tftp { .. } => {
            reply.opts_mut().insert(DhcpOption::TFTPServerName(server.to_string().into_bytes()));
        }
        BootOffer::HttpBoot { .. } => {
            // UEFI HTTP boot ignores offers that do not echo its vendor class.
            reply.opts_mut().insert(DhcpOption::ClassIdentifier(HTTP_CLIENT.to_vec()));
        }
        BootOffer::Script { .. } => {}
    }
    if client.firmware_boot && !matches!(offer, BootOffer::HttpBoot { .. }) {
        // EDK2 and PXE ROMs treat an offer without "PXEClient" as carrying no boot server.
        reply.opts_mut().insert(DhcpOption::ClassIdentifier(PXE_CLIENT.to_vec()));
    }
}

/// Where a reply goes (RFC 2131 4.1): to the relay if there is one, to a configured client at
/// its address, otherwise broadcast (which every client accepts, and which needs no ARP entry
/// for an address the client does not have yet).
fn destination(msg: &Message, t: MessageType) -> SocketAddrV4 {
    if !msg.giaddr().is_unspecified() {
        return SocketAddrV4::new(msg.giaddr(), SERVER_PORT);
    }
    if t != MessageType::Nak && !msg.ciaddr().is_unspecified() {
        return SocketAddrV4::new(msg.ciaddr(), CLIENT_PORT);
    }
    SocketAddrV4::new(Ipv4Addr::BROADCAST, CLIENT_PORT)
}

fn describe_client(c: &BootClient) -> String {
    let arch = match c.arch {
        Some(a) => format!("{a:?}"),
        None => "none".to_owned(),
    };
    format!("arch={arch} ipxe={} firmware-boot={}", c.ipxe, c.firmware_boot)
}

fn describe_answer(a: &Answer) -> String {
    match a {
        Answer::Boot(offer) => format!("boot={}", offer.boot_file()),
        Answer::AddressOnly(reason) => format!("no boot: {reason}"),
        Answer::Ignore => "no boot".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dhcp::relay_agent::RelayPin;
    use crate::dhcp::settings::{NetworkPlan, Reservation, Settings, SubnetSettings, TrustedRelay};
    use crate::inventory::{BootAction, BootRequest, BoxFuture, LocalBoot};
    use crate::neighbors::Neighbors;
    use dhcproto::v4::Architecture;
    use std::sync::Mutex;

    const NOW: UnixTime = 2_000_000;
    const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

    /// Boots every MAC except those starting 02:.
    struct TestInventory;
    impl Inventory for TestInventory {
        fn boots(&self, mac: MacAddr) -> bool {
            mac.octets()[0] != 2
        }
        fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
            Box::pin(async { Some(BootAction::LocalDisk(LocalBoot::Exit)) })
        }
    }

    struct Harness {
        server: DhcpServer,
        leases: SharedLeases,
        _ipxe: tempfile::TempDir,
    }

    fn subnet(cidr: &str, pool: &str) -> SubnetSettings {
        SubnetSettings {
            subnet: cidr.parse().unwrap(),
            pools: vec![pool.parse().unwrap()],
            router: Some(cidr.replace(".0/24", ".1").parse().unwrap()),
            dns: vec!["10.0.0.53".parse().unwrap()],
            domain: Some("lab.example".into()),
            lease_time: None,
        }
    }

    fn harness(mode: DhcpMode) -> Harness {
        harness_with(mode, |_| {})
    }

    fn harness_with(mode: DhcpMode, adjust: impl FnOnce(&mut Context)) -> Harness {
        harness_with_pool(mode, "10.0.0.100-10.0.0.102", adjust)
    }

    /// [`harness_with`], with `pool` as the local subnet's pool.
    fn harness_with_pool(mode: DhcpMode, pool: &str, adjust: impl FnOnce(&mut Context)) -> Harness {
        harness_from(mode, pool, false, adjust)
    }

    /// [`harness_with_pool`], with relayed leases identity or not (`trust_relayed_leases`).
    fn harness_from(
        mode: DhcpMode,
        pool: &str,
        trust_relayed_leases: bool,
        adjust: impl FnOnce(&mut Context),
    ) -> Harness {
        let ipxe = tempfile::tempdir().unwrap();
        std::fs::write(ipxe.path().join("undionly.kpxe"), b"x").unwrap();
        std::fs::write(ipxe.path().join("snponly.efi"), b"x").unwrap();
        let settings = Settings {
            mode,
            subnets: vec![
                subnet("10.0.0.0/24", pool),
                subnet("10.0.5.0/24", "10.0.5.100-10.0.5.102"),
            ],
            reservations: vec![Reservation {
                mac: mac(0x99),
                address: "10.0.0.20".parse().unwrap(),
                hostname: Some("node-r".into()),
            }],
            trusted_relays: vec![TrustedRelay::at(ip("10.0.5.1"))],
            trust_relayed_leases,
            ..Settings::default()
        };
        let plan = NetworkPlan::new(&settings, SERVER, "dhcp").unwrap();
        let mut ctx = Context {
            mode,
            endpoints: Endpoints { address: SERVER, http_port: 8080 },
            binaries: Arc::new(IpxeBinaries::discover(ipxe.path())),
            inventory: Arc::new(TestInventory),
            timeline: Arc::new(Timeline::new()),
            metrics: Arc::new(Metrics::new()),
            known_hosts_only: false,
        };
        adjust(&mut ctx);
        let leases = Arc::new(Mutex::new(LeaseTable::new(Arc::new(plan))));
        Harness { server: DhcpServer::new(ctx, leases.clone()), leases, _ipxe: ipxe }
    }

    fn mac(n: u8) -> MacAddr {
        MacAddr::new([0x52, 0x54, 0, 0, 0, n])
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn request(m: MacAddr, t: MessageType, opts: Vec<DhcpOption>) -> Message {
        let mut msg = Message::default();
        msg.set_chaddr(&m.octets()).set_xid(0x1234);
        msg.opts_mut().insert(DhcpOption::MessageType(t));
        for o in opts {
            msg.opts_mut().insert(o);
        }
        msg
    }

    const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, CLIENT_PORT);

    impl Harness {
        /// Who holds what, as TFTP and HTTP see it, with these complete ARP entries.
        fn neighbors(&self, arp: Vec<(Ipv4Addr, MacAddr)>) -> Neighbors {
            match self.server.ctx.mode {
                DhcpMode::Full => {
                    let inventory = self.server.ctx.inventory.clone();
                    Neighbors::from_leases(self.leases.clone(), inventory, arp)
                }
                DhcpMode::Proxy | DhcpMode::Off => Neighbors::from_arp(arp),
            }
        }

        fn send(
            &self,
            msg: &Message,
            port: Port,
            from: SocketAddrV4,
        ) -> (Option<(Message, SocketAddrV4)>, Option<LeaseRecord>) {
            let outcome = self.server.handle(&encode(msg), from, port, NOW);
            let reply = outcome.reply.map(|r| {
                assert!(r.bytes.len() >= MIN_REPLY_LEN);
                (Message::decode(&mut Decoder::new(&r.bytes)).unwrap(), r.to)
            });
            (reply, outcome.record)
        }

        fn dora(&self, m: MacAddr, opts: Vec<DhcpOption>) -> Message {
            let (offer, _) =
                self.send(&request(m, MessageType::Discover, opts.clone()), Port::Dhcp, CLIENT);
            let (offer, _) = offer.expect("an offer");
            let mut req_opts = opts;
            req_opts.push(DhcpOption::ServerIdentifier(SERVER));
            req_opts.push(DhcpOption::RequestedIpAddress(offer.yiaddr()));
            let (ack, record) =
                self.send(&request(m, MessageType::Request, req_opts), Port::Dhcp, CLIENT);
            let (ack, _) = ack.expect("an ack");
            assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
            assert!(
                matches!(record, Some(LeaseRecord::Lease(ref l)) if l.addr == ack.yiaddr() && l.mac == m)
            );
            ack
        }
    }

    /// The `file` field as a string (dhcproto keeps the terminating NUL when decoding).
    fn file(m: &Message) -> &str {
        m.fname_str().unwrap().unwrap().trim_end_matches('\0')
    }

    fn opt(m: &Message, code: OptionCode) -> Option<&DhcpOption> {
        m.opts().get(code)
    }

    #[test]
    fn discover_offer_request_ack() {
        let h = harness(DhcpMode::Full);
        let (offer, record) =
            h.send(&request(mac(1), MessageType::Discover, vec![]), Port::Dhcp, CLIENT);
        let (offer, to) = offer.unwrap();
        assert!(record.is_none(), "an offer is not durable");
        assert_eq!(to, SocketAddrV4::new(Ipv4Addr::BROADCAST, CLIENT_PORT));
        assert_eq!(offer.opts().msg_type(), Some(MessageType::Offer));
        assert_eq!(offer.yiaddr(), ip("10.0.0.100"));
        assert_eq!(offer.xid(), 0x1234);
        assert_eq!(
            opt(&offer, OptionCode::SubnetMask),
            Some(&DhcpOption::SubnetMask(ip("255.255.255.0")))
        );
        assert_eq!(
            opt(&offer, OptionCode::Router),
            Some(&DhcpOption::Router(vec![ip("10.0.0.1")]))
        );
        assert_eq!(
            opt(&offer, OptionCode::DomainNameServer),
            Some(&DhcpOption::DomainNameServer(vec![ip("10.0.0.53")]))
        );
        assert_eq!(
            opt(&offer, OptionCode::DomainName),
            Some(&DhcpOption::DomainName("lab.example".into()))
        );
        assert_eq!(
            opt(&offer, OptionCode::AddressLeaseTime),
            Some(&DhcpOption::AddressLeaseTime(3600))
        );
        assert_eq!(opt(&offer, OptionCode::Renewal), Some(&DhcpOption::Renewal(1800)));
        assert_eq!(opt(&offer, OptionCode::Rebinding), Some(&DhcpOption::Rebinding(3150)));
        assert_eq!(
            opt(&offer, OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(SERVER))
        );
        assert!(offer.fname().is_none(), "an OS client gets no boot file");
        let ack = h.dora(mac(1), vec![]);
        assert_eq!(ack.yiaddr(), ip("10.0.0.100"));
        assert_eq!(h.dora(mac(2), vec![]).yiaddr(), ip("10.0.0.101"));
        assert_eq!(h.dora(mac(1), vec![]).yiaddr(), ip("10.0.0.100"), "same MAC, same address");
    }

    #[test]
    fn requests_for_other_servers_wrong_or_foreign_addresses() {
        let h = harness(DhcpMode::Full);
        h.dora(mac(1), vec![]);
        // Another server's offer was chosen: silence, and the offer is dropped.
        h.send(&request(mac(2), MessageType::Discover, vec![]), Port::Dhcp, CLIENT);
        let other = vec![
            DhcpOption::ServerIdentifier(ip("10.0.0.2")),
            DhcpOption::RequestedIpAddress(ip("10.0.0.101")),
        ];
        assert!(
            h.send(&request(mac(2), MessageType::Request, other), Port::Dhcp, CLIENT).0.is_none()
        );
        assert_eq!(h.server.table().free_count(0), 2);

        let nak = |h: &Harness, m, addr: &str| {
            let (r, rec) = h.send(
                &request(m, MessageType::Request, vec![DhcpOption::RequestedIpAddress(ip(addr))]),
                Port::Dhcp,
                CLIENT,
            );
            assert!(rec.is_none());
            let (r, to) = r.unwrap();
            assert_eq!(
                (r.opts().msg_type(), to.ip()),
                (Some(MessageType::Nak), &Ipv4Addr::BROADCAST),
                "{addr}"
            );
            assert_eq!(r.yiaddr(), Ipv4Addr::UNSPECIFIED);
        };
        nak(&h, mac(3), "192.168.1.5"); // not on this network (INIT-REBOOT after moving)
        nak(&h, mac(3), "10.0.0.100"); // mac(1)'s lease
        nak(&h, mac(3), "10.0.0.50"); // outside the pools
        nak(&h, mac(3), "10.0.0.20"); // reserved for another MAC
        nak(&h, mac(0x99), "10.0.0.101"); // this MAC is reserved elsewhere

        // INIT-REBOOT of its own address is acknowledged.
        let (r, rec) = h.send(
            &request(
                mac(1),
                MessageType::Request,
                vec![DhcpOption::RequestedIpAddress(ip("10.0.0.100"))],
            ),
            Port::Dhcp,
            CLIENT,
        );
        assert_eq!(r.unwrap().0.opts().msg_type(), Some(MessageType::Ack));
        assert!(rec.is_some());
    }

    #[test]
    fn renew_rebind_release_decline_inform() {
        let h = harness(DhcpMode::Full);
        // A MAC the inventory does not know: a known host's lease outlives its RELEASE and
        // DECLINE (see the abuse tests below).
        let client = stranger(1);
        let addr = h.dora(client, vec![]).yiaddr();
        // RENEWING: unicast, ciaddr set, no server id or requested address.
        let mut renew = request(client, MessageType::Request, vec![]);
        renew.set_ciaddr(addr);
        let (r, rec) = h.send(&renew, Port::Dhcp, SocketAddrV4::new(addr, CLIENT_PORT));
        let (ack, to) = r.unwrap();
        assert_eq!(
            (ack.opts().msg_type(), ack.yiaddr(), to),
            (Some(MessageType::Ack), addr, SocketAddrV4::new(addr, CLIENT_PORT))
        );
        assert!(rec.is_some(), "a renewal extends the lease durably");
        // Another MAC renewing that address is refused.
        let mut foreign = request(mac(2), MessageType::Request, vec![]);
        foreign.set_ciaddr(addr);
        let (r, _) = h.send(&foreign, Port::Dhcp, CLIENT);
        assert_eq!(r.unwrap().0.opts().msg_type(), Some(MessageType::Nak));

        // INFORM: configuration only, no address, to the client's address.
        let mut inform = request(client, MessageType::Inform, vec![]);
        inform.set_ciaddr(addr);
        let (r, rec) = h.send(&inform, Port::Dhcp, CLIENT);
        let (ack, to) = r.unwrap();
        assert!(rec.is_none());
        assert_eq!(
            (ack.yiaddr(), to.ip(), opt(&ack, OptionCode::AddressLeaseTime)),
            (Ipv4Addr::UNSPECIFIED, &addr, None)
        );

        // RELEASE (unicast from the client's address): durable, no reply, and the address goes
        // back to the pool.
        let mut release =
            request(client, MessageType::Release, vec![DhcpOption::ServerIdentifier(SERVER)]);
        release.set_ciaddr(addr);
        let (r, rec) = h.send(&release, Port::Dhcp, SocketAddrV4::new(addr, CLIENT_PORT));
        assert!(r.is_none());
        assert!(matches!(rec, Some(LeaseRecord::Lease(ref l)) if l.expires == NOW));
        assert!(h.server.table().available_to(addr, mac(7), NOW));

        // DECLINE: the address is quarantined and the client gets another one.
        let addr = h.dora(client, vec![]).yiaddr();
        let decline = request(
            client,
            MessageType::Decline,
            vec![DhcpOption::ServerIdentifier(SERVER), DhcpOption::RequestedIpAddress(addr)],
        );
        let (r, rec) = h.send(&decline, Port::Dhcp, CLIENT);
        assert!(r.is_none());
        assert!(
            matches!(rec, Some(LeaseRecord::Declined { addr: a, until }) if a == addr && until == NOW + 600)
        );
        assert_ne!(h.dora(client, vec![]).yiaddr(), addr);
    }

    #[test]
    fn reservations_get_their_address_and_hostname() {
        let h = harness(DhcpMode::Full);
        let ack = h.dora(mac(0x99), vec![]);
        assert_eq!(ack.yiaddr(), ip("10.0.0.20"));
        assert_eq!(opt(&ack, OptionCode::Hostname), Some(&DhcpOption::Hostname("node-r".into())));
    }

    #[test]
    fn relayed_requests_use_the_relay_subnet() {
        let h = harness(DhcpMode::Full);
        let mut discover = request(mac(1), MessageType::Discover, vec![]);
        discover.set_giaddr(ip("10.0.5.1"));
        let relay = SocketAddrV4::new(ip("10.0.5.1"), SERVER_PORT);
        let (r, _) = h.send(&discover, Port::Dhcp, relay);
        let (offer, to) = r.unwrap();
        assert_eq!((offer.yiaddr(), to, offer.giaddr()), (ip("10.0.5.100"), relay, ip("10.0.5.1")));
        assert_eq!(
            opt(&offer, OptionCode::Router),
            Some(&DhcpOption::Router(vec![ip("10.0.5.1")]))
        );
    }

    #[test]
    fn known_hosts_only_answers_the_inventory_s_macs_alone() {
        let unknown = MacAddr::new([2, 0, 0, 0, 0, 1]);
        let discover = request(unknown, MessageType::Discover, vec![]);
        let asks_for = |addr| {
            request(unknown, MessageType::Request, vec![DhcpOption::RequestedIpAddress(ip(addr))])
        };
        // Off (the standalone default): an unknown MAC gets an address, and no boot file.
        let h = harness(DhcpMode::Full);
        assert!(h.send(&discover, Port::Dhcp, CLIENT).0.is_some());
        assert!(h.send(&asks_for("10.0.0.100"), Port::Dhcp, CLIENT).0.is_some());

        let h = harness_with(DhcpMode::Full, |ctx| ctx.known_hosts_only = true);
        let (r, _) = h.send(&discover, Port::Dhcp, CLIENT);
        assert!(r.is_none(), "no offer");
        let (r, record) = h.send(&asks_for("10.0.0.100"), Port::Dhcp, CLIENT);
        assert!(r.is_none() && record.is_none(), "no ACK, and no NAK either");
        assert_eq!(h.server.ctx.metrics.dhcp_dropped.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert_eq!(h.server.table().free_count(0), 3, "nothing offered or leased");
        assert_eq!(h.dora(mac(1), vec![]).yiaddr(), ip("10.0.0.100"), "a known MAC");
    }

    /// Knows nothing until its first list of hosts arrives.
    struct SyncingInventory;
    impl Inventory for SyncingInventory {
        fn ready(&self) -> Result<(), &'static str> {
            Err("still listing hosts")
        }
        fn boots(&self, _: MacAddr) -> bool {
            false
        }
        fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
            Box::pin(async { None })
        }
    }

    #[test]
    fn nothing_is_answered_until_the_inventory_is_ready() {
        for mode in [DhcpMode::Full, DhcpMode::Proxy] {
            let h = harness_with(mode, |ctx| ctx.inventory = Arc::new(SyncingInventory));
            let discover = request(mac(1), MessageType::Discover, vec![]);
            let (reply, record) = h.send(&discover, Port::Dhcp, CLIENT);
            assert!(reply.is_none() && record.is_none(), "{mode:?}: no answer, not even a NAK");
            assert_eq!(h.server.table().free_count(0), 3, "{mode:?}: nothing offered");
        }
    }

    #[test]
    fn relayed_messages_are_answered_only_from_trusted_relays() {
        let dropped = |h: &Harness| {
            h.server.ctx.metrics.dhcp_dropped.load(std::sync::atomic::Ordering::Relaxed)
        };
        for mode in [DhcpMode::Full, DhcpMode::Proxy] {
            let h = harness(mode);
            // A relay in a served subnet but not trusted, and one claiming a foreign subnet.
            for giaddr in ["10.0.5.2", "172.16.0.1"] {
                let mut discover = request(mac(1), MessageType::Discover, pxe_opts(0));
                discover.set_giaddr(ip(giaddr));
                let from = SocketAddrV4::new(ip(giaddr), SERVER_PORT);
                assert!(h.send(&discover, Port::Dhcp, from).0.is_none(), "{mode:?} {giaddr}");
            }
            assert_eq!(dropped(&h), 2, "{mode:?}");
            let mut discover = request(mac(1), MessageType::Discover, pxe_opts(0));
            discover.set_giaddr(ip("10.0.5.1"));
            // The trusted relay's giaddr from another machine of the segment (the attack), or
            // from the relay's subnet.
            for source in ["10.0.0.77", "10.0.5.7"] {
                let from = SocketAddrV4::new(ip(source), SERVER_PORT);
                assert!(h.send(&discover, Port::Dhcp, from).0.is_none(), "{mode:?} {source}");
            }
            assert_eq!(dropped(&h), 4, "{mode:?}");
            let from = SocketAddrV4::new(ip("10.0.5.1"), SERVER_PORT);
            let (r, _) = h.send(&discover, Port::Dhcp, from);
            assert_eq!(r.unwrap().1, from, "{mode:?}: answered through the trusted relay");
            assert_eq!(dropped(&h), 4);
            let text = h.server.ctx.metrics.render(&Timeline::new());
            for line in [
                "siteboot_dhcp_relayed_dropped_total{reason=\"untrusted-relay\"} 2",
                "siteboot_dhcp_relayed_dropped_total{reason=\"unexpected-source\"} 2",
            ] {
                assert!(text.contains(line), "{mode:?}: {line}\n{text}");
            }
        }
    }

    /// RFC 3046 2.2: a server echoes the relay agent information option verbatim in every
    /// reply to a relayed request (relays drop replies without it, or forward them to the
    /// wrong port); this one is not even well-formed sub-options, and goes back as it came.
    #[test]
    fn replies_to_relayed_requests_echo_the_relay_agent_information() {
        // Circuit-id "eth1/7", remote-id 4 bytes, and a sub-option that runs past the end.
        let info: Vec<u8> =
            [&[1, 6][..], b"eth1/7", &[2, 4, 0xde, 0xad, 0xbe, 0xef], &[9, 200, 1]].concat();
        let with_info = |mut msg: Message, giaddr: &str| {
            msg.set_giaddr(ip(giaddr));
            let mut bytes = encode(&msg);
            append_option(&mut bytes, RELAY_AGENT_INFORMATION, &info);
            bytes
        };
        let echoed = |bytes: &[u8]| keep_read_options(bytes).unwrap().1;
        let relay = SocketAddrV4::new(ip("10.0.5.1"), SERVER_PORT);
        for mode in [DhcpMode::Full, DhcpMode::Proxy] {
            let h = harness(mode);
            let discover =
                with_info(request(mac(1), MessageType::Discover, pxe_opts(0)), "10.0.5.1");
            let offer = h.server.handle(&discover, relay, Port::Dhcp, NOW).reply.unwrap();
            assert_eq!(echoed(&offer.bytes), Some(info.clone()), "{mode:?}: the OFFER");
            // Not relayed: a client's own option 82 proves nothing and is not echoed.
            let direct = with_info(request(mac(2), MessageType::Discover, pxe_opts(0)), "0.0.0.0");
            let offer = h.server.handle(&direct, CLIENT, Port::Dhcp, NOW).reply.unwrap();
            assert_eq!(echoed(&offer.bytes), None, "{mode:?}: not relayed");
        }
        let h = harness(DhcpMode::Full);
        let ask = |addr: &str| {
            let opts = vec![
                DhcpOption::ServerIdentifier(SERVER),
                DhcpOption::RequestedIpAddress(ip(addr)),
            ];
            with_info(request(mac(1), MessageType::Request, opts), "10.0.5.1")
        };
        let ack = h.server.handle(&ask("10.0.5.100"), relay, Port::Dhcp, NOW).reply.unwrap();
        assert_eq!(decode_type(&ack.bytes), Some(MessageType::Ack));
        assert_eq!(echoed(&ack.bytes), Some(info.clone()), "the ACK");
        let nak = h.server.handle(&ask("10.0.0.100"), relay, Port::Dhcp, NOW).reply.unwrap();
        assert_eq!(decode_type(&nak.bytes), Some(MessageType::Nak));
        assert_eq!(echoed(&nak.bytes), Some(info.clone()), "the NAK");
        let mut inform = request(mac(1), MessageType::Inform, vec![]);
        inform.set_ciaddr(ip("10.0.5.100"));
        let ack = h.server.handle(&with_info(inform, "10.0.5.1"), relay, Port::Dhcp, NOW).reply;
        assert_eq!(echoed(&ack.unwrap().bytes), Some(info), "the INFORM's ACK");
        // Longer than one option holds: split, and joined again (RFC 3396).
        let long: Vec<u8> = (0..300u16).map(|n| n as u8).collect();
        let mut bytes = encode(&request(mac(1), MessageType::Discover, vec![]));
        append_option(&mut bytes, RELAY_AGENT_INFORMATION, &long);
        assert_eq!(echoed(&bytes), Some(long));
    }

    /// [`TestInventory`], with mac(1) pinned to port `eth1/0/12` of its relay.
    struct PinnedInventory;
    impl Inventory for PinnedInventory {
        fn boots(&self, m: MacAddr) -> bool {
            TestInventory.boots(m)
        }
        fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
            Box::pin(async { Some(BootAction::LocalDisk(LocalBoot::Exit)) })
        }
        fn relay_pin(&self, m: MacAddr) -> Option<RelayPin> {
            (m == mac(1)).then(|| RelayPin::new(Some("eth1/0/12".parse().unwrap()), None).unwrap())
        }
    }

    /// `msg` relayed by the trusted relay 10.0.5.1, with `info` as option 82 if any.
    fn relayed(mut msg: Message, info: Option<&[u8]>) -> Vec<u8> {
        msg.set_giaddr(ip("10.0.5.1"));
        let mut bytes = encode(&msg);
        if let Some(info) = info {
            append_option(&mut bytes, RELAY_AGENT_INFORMATION, info);
        }
        bytes
    }

    /// Option 82 with one circuit-id sub-option, `port`.
    fn circuit_id(port: &[u8]) -> Vec<u8> {
        [&[1, port.len() as u8][..], port].concat()
    }

    fn pin_mismatches(h: &Harness) -> String {
        let text = h.server.ctx.metrics.render(&Timeline::new());
        let series = "siteboot_dhcp_relayed_dropped_total{reason=\"relay-agent-mismatch\"} ";
        text.lines().find_map(|l| l.strip_prefix(series)).unwrap().to_owned()
    }

    /// Issue 22, item 2: a machine on another port of the trusted relay forges a pinned host's
    /// MAC. The relay says where each message came in (option 82): the pinned MAC is answered
    /// only through its own port, in either mode; other MACs, and the pinned MAC sent directly
    /// (a client's own option 82 says nothing), as before.
    #[test]
    fn relayed_messages_for_a_pinned_host_are_answered_only_through_its_port() {
        let relay = SocketAddrV4::new(ip("10.0.5.1"), SERVER_PORT);
        let (own, other) = (circuit_id(b"eth1/0/12"), circuit_id(b"eth1/0/13"));
        let remote_id = [&[2, 9][..], b"eth1/0/12"].concat();
        let discover = |m| request(m, MessageType::Discover, pxe_opts(0));
        for mode in [DhcpMode::Full, DhcpMode::Proxy] {
            let h = harness_with(mode, |ctx| ctx.inventory = Arc::new(PinnedInventory));
            let send = |bytes: &[u8], from| h.server.handle(bytes, from, Port::Dhcp, NOW).reply;
            for info in [Some(&other[..]), None, Some(&remote_id[..]), Some(&[1, 40, 0][..])] {
                let reply = send(&relayed(discover(mac(1)), info), relay);
                assert!(reply.is_none(), "{mode:?}: answered through {info:?}");
            }
            assert_eq!(pin_mismatches(&h), "4", "{mode:?}: each counted");
            // Logged once for the MAC.
            let mut refused = h.server.refused_pins.lock().unwrap();
            assert_eq!(refused.refused(mac(1)), RefusalLog::Quiet, "{mode:?}");
            drop(refused);
            let own_and_more = [&own[..], &[9, 2, 0, 1], &remote_id].concat();
            let offer = send(&relayed(discover(mac(1)), Some(&own_and_more)), relay);
            let offer = offer.unwrap_or_else(|| panic!("{mode:?}: not answered through its port"));
            assert_eq!(keep_read_options(&offer.bytes).unwrap().1, Some(own_and_more), "echoed");
            assert!(send(&relayed(discover(mac(2)), Some(&other)), relay).is_some(), "no pin");
            assert!(send(&encode(&discover(mac(1))), CLIENT).is_some(), "{mode:?}: direct");
            let mut forged = encode(&discover(mac(1)));
            append_option(&mut forged, RELAY_AGENT_INFORMATION, &other);
            assert!(send(&forged, CLIENT).is_some(), "{mode:?}: direct, with its own option 82");
            assert_eq!(pin_mismatches(&h), "4", "{mode:?}");
        }
    }

    /// Full mode, relayed leases trusted: the pinned host's lease, granted through its port,
    /// keeps what the pin names and is its identity; a REQUEST forging its MAC from another
    /// port neither takes nor renews it.
    #[test]
    fn a_pinned_host_s_lease_is_granted_only_through_its_port_and_keeps_it() {
        let h = harness_from(DhcpMode::Full, "10.0.0.100-10.0.0.102", true, |ctx| {
            ctx.inventory = Arc::new(PinnedInventory)
        });
        let relay = SocketAddrV4::new(ip("10.0.5.1"), SERVER_PORT);
        let (own, other) = (circuit_id(b"eth1/0/12"), circuit_id(b"eth1/0/13"));
        let send = |msg: Message, info: &[u8]| {
            let outcome = h.server.handle(&relayed(msg, Some(info)), relay, Port::Dhcp, NOW);
            let reply =
                outcome.reply.map(|r| Message::decode(&mut Decoder::new(&r.bytes)).unwrap());
            (reply, outcome.record)
        };
        let ask = |addr| {
            let opts =
                vec![DhcpOption::ServerIdentifier(SERVER), DhcpOption::RequestedIpAddress(addr)];
            request(mac(1), MessageType::Request, opts)
        };
        let addr = ip("10.0.5.100");
        assert_eq!(send(ask(addr), &other), (None, None), "a REQUEST through another port");
        let (ack, record) = send(ask(addr), &[&own[..], &[2, 2, b's', b'w']].concat());
        assert_eq!(ack.unwrap().opts().msg_type(), Some(MessageType::Ack));
        let Some(LeaseRecord::Lease(lease)) = record else { panic!("no lease: {record:?}") };
        let pin = PinnedInventory.relay_pin(mac(1)).unwrap();
        assert_eq!(lease.relay_agent, pin.as_info(), "the pinned sub-option, nothing more");
        let identity = Some(crate::neighbors::Holder {
            mac: mac(1),
            evidence: crate::neighbors::Evidence::Lease,
        });
        assert_eq!(h.neighbors(vec![]).holder_at(addr, NOW), identity);
        // The forger's renewal through its own port changes nothing.
        let mut renew = request(mac(1), MessageType::Request, vec![]);
        renew.set_ciaddr(addr);
        assert_eq!(send(renew, &other), (None, None));
        assert_eq!(h.neighbors(vec![]).holder_at(addr, NOW), identity);
        // A MAC with no pin: its relayed lease keeps nothing, and is identity as before.
        let (_, record) = send(
            request(
                mac(2),
                MessageType::Request,
                vec![
                    DhcpOption::ServerIdentifier(SERVER),
                    DhcpOption::RequestedIpAddress(ip("10.0.5.101")),
                ],
            ),
            &other,
        );
        let Some(LeaseRecord::Lease(lease)) = record else { panic!("no lease: {record:?}") };
        assert!(lease.relay_agent.is_empty());
        let holder = h.neighbors(vec![]).holder_at(ip("10.0.5.101"), NOW);
        assert_eq!(holder.map(|h| h.mac), Some(mac(2)));
    }

    fn pxe_opts(arch: u16) -> Vec<DhcpOption> {
        vec![
            DhcpOption::ClientSystemArchitecture(Architecture(arch)),
            DhcpOption::ClassIdentifier(
                format!("PXEClient:Arch:{arch:05}:UNDI:002001").into_bytes(),
            ),
            DhcpOption::ClientMachineIdentifier(vec![0; 17]),
        ]
    }

    #[test]
    fn full_mode_boot_information() {
        let h = harness(DhcpMode::Full);
        let ack = h.dora(mac(1), pxe_opts(0));
        assert_eq!(file(&ack), "undionly.kpxe");
        assert_eq!(ack.siaddr(), SERVER);
        assert_eq!(
            opt(&ack, OptionCode::ClassIdentifier),
            Some(&DhcpOption::ClassIdentifier(b"PXEClient".to_vec()))
        );
        assert_eq!(file(&h.dora(mac(2), pxe_opts(7))), "snponly.efi");
        let mut ipxe = pxe_opts(0);
        ipxe.push(DhcpOption::UserClass(b"iPXE".to_vec()));
        assert_eq!(file(&h.dora(mac(1), ipxe)), "http://10.0.0.1:8080/boot/52-54-00-00-00-01.ipxe");
        let unknown = MacAddr::new([2, 0, 0, 0, 0, 1]);
        let ack = h.dora(unknown, pxe_opts(0));
        assert!(ack.fname().is_none(), "not in the inventory: address only");
    }

    #[test]
    fn proxy_mode_answers_pxe_clients_only_and_serves_port_4011() {
        let h = harness(DhcpMode::Proxy);
        let (r, rec) =
            h.send(&request(mac(1), MessageType::Discover, pxe_opts(7)), Port::Dhcp, CLIENT);
        assert!(rec.is_none());
        let (offer, to) = r.unwrap();
        assert_eq!(offer.opts().msg_type(), Some(MessageType::Offer));
        assert_eq!(
            (offer.yiaddr(), offer.siaddr(), to.ip()),
            (Ipv4Addr::UNSPECIFIED, SERVER, &Ipv4Addr::BROADCAST)
        );
        assert_eq!(file(&offer), "snponly.efi");
        assert!(opt(&offer, OptionCode::ClientMachineIdentifier).is_some(), "GUID echoed");
        assert!(opt(&offer, OptionCode::AddressLeaseTime).is_none());
        assert!(
            opt(&offer, OptionCode::VendorExtensions).is_none(),
            "no option 43: UEFI asks on 4011"
        );

        assert!(
            h.send(&request(mac(1), MessageType::Discover, vec![]), Port::Dhcp, CLIENT).0.is_none(),
            "OS client"
        );
        let unknown = MacAddr::new([2, 0, 0, 0, 0, 1]);
        assert!(
            h.send(&request(unknown, MessageType::Discover, pxe_opts(0)), Port::Dhcp, CLIENT)
                .0
                .is_none()
        );
        let mut req = pxe_opts(7);
        req.push(DhcpOption::ServerIdentifier(ip("10.0.0.2")));
        assert!(
            h.send(&request(mac(1), MessageType::Request, req), Port::Dhcp, CLIENT).0.is_none(),
            "the real server's business"
        );

        let mut boot_req = request(mac(1), MessageType::Request, pxe_opts(7));
        boot_req.set_ciaddr(ip("10.0.0.150"));
        let from = SocketAddrV4::new(ip("10.0.0.150"), CLIENT_PORT);
        let (r, _) = h.send(&boot_req, Port::Pxe, from);
        let (ack, to) = r.unwrap();
        assert_eq!(
            (ack.opts().msg_type(), to, ack.ciaddr()),
            (Some(MessageType::Ack), from, ip("10.0.0.150"))
        );
        assert_eq!(file(&ack), "snponly.efi");

        // iPXE through the proxy: the script URL, with next-server set (iPXE ignores a proxy
        // answer without siaddr).
        let mut ipxe = pxe_opts(0);
        ipxe.push(DhcpOption::UserClass(b"iPXE".to_vec()));
        let (r, _) = h.send(&request(mac(1), MessageType::Request, ipxe), Port::Pxe, from);
        let (ack, _) = r.unwrap();
        assert_eq!(file(&ack), "http://10.0.0.1:8080/boot/52-54-00-00-00-01.ipxe");
        assert_eq!(ack.siaddr(), SERVER);
    }

    /// Anyone can send a port-4011 REQUEST with any `chaddr`: it is answered (boot information
    /// is no secret) but says nothing about who holds the address it came from.
    #[test]
    fn port_4011_teaches_nothing_about_who_holds_an_address() {
        let mut ipxe = pxe_opts(0);
        ipxe.push(DhcpOption::UserClass(b"iPXE".to_vec()));
        let intruder = mac(7);

        let h = harness(DhcpMode::Proxy);
        let from = SocketAddrV4::new(ip("10.0.0.150"), CLIENT_PORT);
        let (r, _) = h.send(&request(mac(1), MessageType::Request, ipxe.clone()), Port::Pxe, from);
        assert_eq!(r.unwrap().0.opts().msg_type(), Some(MessageType::Ack));
        assert_eq!(h.neighbors(vec![]).holder_at(*from.ip(), NOW), None);
        let seen = h.neighbors(vec![(*from.ip(), intruder)]).holder_at(*from.ip(), NOW);
        assert_eq!(seen.map(|h| h.mac), Some(intruder), "the ARP entry, not the chaddr");

        let h = harness(DhcpMode::Full);
        let addr = h.dora(intruder, vec![]).yiaddr();
        let from = SocketAddrV4::new(addr, CLIENT_PORT);
        let (r, _) = h.send(&request(mac(1), MessageType::Request, ipxe), Port::Pxe, from);
        assert_eq!(r.unwrap().0.opts().msg_type(), Some(MessageType::Ack));
        let holder = h.neighbors(vec![(addr, intruder)]).holder_at(addr, NOW);
        assert_eq!(holder.map(|h| h.mac), Some(intruder), "still the lessee");
    }

    /// Full mode: a machine gives back its lease and asks for the same address with another
    /// MAC. DHCP cannot tell this from a host changing NICs, so it ACKs; the ARP table, which
    /// still names the machine's own MAC, denies the address any identity.
    #[test]
    fn a_lease_taken_with_a_forged_chaddr_gives_no_identity() {
        let h = harness(DhcpMode::Full);
        let (intruder, victim) = (stranger(7), mac(1));
        let addr = h.dora(intruder, vec![]).yiaddr();
        let from = SocketAddrV4::new(addr, CLIENT_PORT);
        let mut release =
            request(intruder, MessageType::Release, vec![DhcpOption::ServerIdentifier(SERVER)]);
        release.set_ciaddr(addr);
        h.send(&release, Port::Dhcp, from);
        let mut forged = request(victim, MessageType::Request, vec![]);
        forged.set_ciaddr(addr);
        let (r, record) = h.send(&forged, Port::Dhcp, from);
        assert_eq!(r.unwrap().0.opts().msg_type(), Some(MessageType::Ack));
        assert!(matches!(record, Some(LeaseRecord::Lease(ref l)) if l.mac == victim));
        assert_eq!(h.neighbors(vec![(addr, intruder)]).holder_at(addr, NOW), None);
        // Nor with no complete entry (poisoned with zeros, or ARP never answered): the address
        // is on-link, where only an entry naming the lessee counts.
        assert_eq!(h.neighbors(vec![]).holder_at(addr, NOW), None);
        let agreeing = h.neighbors(vec![(addr, victim)]).holder_at(addr, NOW);
        assert_eq!(agreeing.map(|h| h.mac), Some(victim));
    }

    // ----- DECLINE and RELEASE abuse (issue 22, item 10) -----

    /// A MAC the inventory does not know (`TestInventory` boots none starting 02:).
    fn stranger(n: u8) -> MacAddr {
        MacAddr::new([2, 0, 0, 0, 0, n])
    }

    fn decline_of(m: MacAddr, addr: Ipv4Addr) -> Message {
        request(
            m,
            MessageType::Decline,
            vec![DhcpOption::ServerIdentifier(SERVER), DhcpOption::RequestedIpAddress(addr)],
        )
    }

    fn release_of(m: MacAddr, addr: Ipv4Addr) -> Message {
        let mut release =
            request(m, MessageType::Release, vec![DhcpOption::ServerIdentifier(SERVER)]);
        release.set_ciaddr(addr);
        release
    }

    /// Addresses in quarantine.
    fn quarantined(h: &Harness) -> usize {
        let records = h.server.table().records();
        records.iter().filter(|r| matches!(r, LeaseRecord::Declined { .. })).count()
    }

    impl Harness {
        /// The attack: `m` takes the address DISCOVER offers it, REQUESTs it and DECLINEs it,
        /// `times` times over (each DECLINE used to quarantine one more address).
        fn request_and_decline(&self, m: MacAddr, times: usize) {
            for _ in 0..times {
                let (offer, _) =
                    self.send(&request(m, MessageType::Discover, vec![]), Port::Dhcp, CLIENT);
                let Some((offer, _)) = offer else { return };
                let addr = offer.yiaddr();
                let asks = vec![
                    DhcpOption::ServerIdentifier(SERVER),
                    DhcpOption::RequestedIpAddress(addr),
                ];
                self.send(&request(m, MessageType::Request, asks), Port::Dhcp, CLIENT);
                self.send(&decline_of(m, addr), Port::Dhcp, CLIENT);
            }
        }

        /// Whether a client never seen before is offered an address.
        fn newcomer_gets_an_address(&self, m: MacAddr) -> bool {
            let (offer, _) =
                self.send(&request(m, MessageType::Discover, vec![]), Port::Dhcp, CLIENT);
            offer.is_some()
        }

        /// `m`'s INIT-REBOOT REQUEST for `addr`: the address it is given, if any.
        fn reboot(&self, m: MacAddr, addr: Ipv4Addr) -> Option<Ipv4Addr> {
            let asks = vec![DhcpOption::RequestedIpAddress(addr)];
            let (r, _) = self.send(&request(m, MessageType::Request, asks), Port::Dhcp, CLIENT);
            let (ack, _) = r?;
            (ack.opts().msg_type() == Some(MessageType::Ack)).then(|| ack.yiaddr())
        }
    }

    /// With `known_hosts_only`, one known MAC REQUESTs and DECLINEs address after address: on
    /// the old code every DECLINE quarantined one more until the pool was empty.
    #[test]
    fn a_known_mac_cycling_request_and_decline_cannot_empty_the_pool() {
        let h = harness_with(DhcpMode::Full, |ctx| ctx.known_hosts_only = true);
        h.request_and_decline(mac(1), 10);
        assert_eq!(quarantined(&h), 0, "a known host's DECLINE quarantined its address");
        assert_eq!(h.server.table().free_count(0), 2, "the attacker holds one lease, no more");
        assert!(h.newcomer_gets_an_address(mac(2)), "the pool was emptied");
        assert_eq!(ignored(&h.server.ctx.metrics.dhcp_declines_ignored), 10, "each counted");
    }

    fn ignored(counter: &std::sync::atomic::AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// MACs the inventory does not know (`known_hosts_only` off): each quarantines at most
    /// [`DECLINES_PER_CLIENT`] addresses per window, and all of them together at most half
    /// the pool.
    #[test]
    fn declines_from_unknown_macs_are_bounded_per_mac_and_by_the_reserve() {
        let h = harness_with_pool(DhcpMode::Full, "10.0.0.100-10.0.0.119", |_| {});
        h.request_and_decline(stranger(1), 10);
        assert_eq!(quarantined(&h), 2, "one MAC's budget");
        for n in 2..=8 {
            h.request_and_decline(stranger(n), 5);
        }
        assert_eq!(quarantined(&h), 10, "half of the pool's 20 addresses, no more");
        assert!(h.newcomer_gets_an_address(mac(50)), "the pool was emptied");
        // Every DECLINE that quarantined nothing is counted.
        let declines = 10 + 7 * 5;
        assert_eq!(
            ignored(&h.server.ctx.metrics.dhcp_declines_ignored),
            (declines - quarantined(&h)) as u64
        );
    }

    /// A RELEASE with a provisioning host's `chaddr` and its address in `ciaddr`, sent from
    /// anywhere else on the segment (or relayed), ended the host's lease, and with it the
    /// identity its ramdisk token is bound to.
    #[test]
    fn a_forged_release_does_not_end_a_lease() {
        let h = harness(DhcpMode::Full);
        let attacker = SocketAddrV4::new(ip("10.0.0.150"), CLIENT_PORT);
        let relay = SocketAddrV4::new(ip("10.0.5.1"), SERVER_PORT);
        for victim in [stranger(1), mac(1)] {
            let addr = h.dora(victim, vec![]).yiaddr();
            for from in [attacker, CLIENT, relay] {
                let (reply, record) = h.send(&release_of(victim, addr), Port::Dhcp, from);
                assert!(reply.is_none());
                assert_eq!(record, None, "{victim}'s lease ended by a RELEASE from {from}");
            }
            let holder = h.neighbors(vec![(addr, victim)]).holder_at(addr, NOW);
            assert_eq!(holder.map(|h| h.mac), Some(victim), "{victim} lost {addr}");
            assert_eq!(h.reboot(victim, addr), Some(addr), "{victim}'s next REQUEST");
        }
        // From the lease's own address, unrelayed, a RELEASE is honoured, known host or not.
        for victim in [mac(1), stranger(1)] {
            let addr = h.server.table().lease_of(victim).unwrap().addr;
            let own = SocketAddrV4::new(addr, CLIENT_PORT);
            let (_, record) = h.send(&release_of(victim, addr), Port::Dhcp, own);
            assert!(matches!(record, Some(LeaseRecord::Lease(ref l)) if l.expires == NOW));
        }
        assert_eq!(ignored(&h.server.ctx.metrics.dhcp_releases_ignored), 6, "the forged ones");
    }

    /// A DECLINE comes from 0.0.0.0 and proves nothing: one with a known host's `chaddr`
    /// quarantined its address and took its lease away.
    #[test]
    fn a_forged_decline_does_not_take_a_known_host_s_address() {
        let h = harness(DhcpMode::Full);
        let victim = mac(1);
        let addr = h.dora(victim, vec![]).yiaddr();
        let (_, record) = h.send(&decline_of(victim, addr), Port::Dhcp, CLIENT);
        assert_eq!(record, None, "the known host's address was quarantined");
        let holder = h.neighbors(vec![(addr, victim)]).holder_at(addr, NOW);
        assert_eq!(holder.map(|h| h.mac), Some(victim), "{victim} lost {addr}");
        assert_eq!(h.reboot(victim, addr), Some(addr), "its next REQUEST");
        assert_eq!(h.dora(victim, vec![]).yiaddr(), addr, "and its next DISCOVER");
    }

    /// Knows no MAC at all: only the reservation protects an address.
    struct KnowsNobody;
    impl Inventory for KnowsNobody {
        fn boots(&self, _: MacAddr) -> bool {
            false
        }
        fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
            Box::pin(async { None })
        }
    }

    #[test]
    fn a_forged_decline_or_release_does_not_take_a_reserved_address() {
        let h = harness_with(DhcpMode::Full, |ctx| ctx.inventory = Arc::new(KnowsNobody));
        let owner = mac(0x99);
        let addr = h.dora(owner, vec![]).yiaddr();
        assert_eq!(addr, ip("10.0.0.20"));
        assert_eq!(h.send(&decline_of(owner, addr), Port::Dhcp, CLIENT).1, None);
        assert_eq!(h.send(&release_of(owner, addr), Port::Dhcp, CLIENT).1, None);
        assert_eq!(h.reboot(owner, addr), Some(addr));
        assert_eq!(quarantined(&h), 0);
    }

    #[test]
    fn off_mode_says_nothing() {
        let h = harness(DhcpMode::Off);
        assert!(
            h.send(&request(mac(1), MessageType::Discover, pxe_opts(0)), Port::Dhcp, CLIENT)
                .0
                .is_none()
        );
    }

    #[test]
    fn malformed_datagrams_are_dropped() {
        let h = harness(DhcpMode::Full);
        let good = encode(&request(mac(1), MessageType::Discover, vec![]));
        let mut bad_hlen = good.clone();
        bad_hlen[2] = 17; // chaddr is 16 bytes: a naive slice would panic
        let mut bad_magic = good.clone();
        bad_magic[236] = 0;
        let mut reply_op = good.clone();
        reply_op[0] = 2;
        let mut no_type = request(mac(1), MessageType::Discover, vec![]);
        no_type.opts_mut().remove(OptionCode::MessageType);
        for bytes in [
            vec![],
            vec![1; 10],
            good[..239].to_vec(),
            bad_hlen,
            bad_magic,
            reply_op,
            encode(&no_type),
        ] {
            let outcome = h.server.handle(&bytes, CLIENT, Port::Dhcp, NOW);
            assert!(outcome.reply.is_none() && outcome.record.is_none());
        }
        assert_eq!(h.server.ctx.metrics.dhcp_dropped.load(std::sync::atomic::Ordering::Relaxed), 7);
    }

    /// Found by the fuzzer: dhcproto's decoders for options 94 and 152 (and others) assert on
    /// their length; such options are dropped before decoding and the request still answered.
    #[test]
    fn options_dhcproto_cannot_decode_safely_are_ignored() {
        let h = harness(DhcpMode::Full);
        let good = encode(&request(mac(1), MessageType::Discover, vec![]));
        let end = OPTIONS_OFFSET + good[OPTIONS_OFFSET..].iter().position(|b| *b == 255).unwrap();
        for hostile in [&[94u8, 1, 0][..], &[152, 1, 0], &[81, 1, 0], &[121, 2, 40, 1], &[80, 1, 0]]
        {
            let mut bytes = good[..end].to_vec();
            bytes.extend_from_slice(hostile);
            bytes.push(255);
            let outcome = h.server.handle(&bytes, CLIENT, Port::Dhcp, NOW);
            assert!(outcome.reply.is_some(), "option {hostile:?}");
        }
        // An option running past the end of the datagram: not a DHCP message.
        let mut truncated = good[..end].to_vec();
        truncated.extend_from_slice(&[60, 200, b'P']);
        assert!(h.server.handle(&truncated, CLIENT, Port::Dhcp, NOW).reply.is_none());
    }
}
