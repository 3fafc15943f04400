//! DHCP protocol handling, with no I/O: a datagram and the time go in, a reply and a lease
//! record to make durable come out. The socket loop (`socket.rs`) does the rest.
//!
//! Full mode follows RFC 2131 (DISCOVER/OFFER/REQUEST/ACK/NAK, DECLINE, RELEASE, INFORM, renew
//! and rebind); proxy mode answers PXE clients with boot information only, on port 67 and on
//! the PXE boot-server port 4011 (where UEFI clients ask after a proxy offer without option 43).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use dhcproto::v4::{DhcpOption, Flags, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};
use siteboot_ipxe::IpxeBinaries;

use super::leases::{Lease, LeaseRecord, LeaseTable, UnixTime};
use super::settings::SubnetPlan;
use crate::client::{BootClient, HTTP_CLIENT, PXE_CLIENT};
use crate::decision::{self, Answer, BootOffer, DhcpMode};
use crate::inventory::Inventory;
use crate::metrics::Metrics;
use crate::neighbors::Neighbors;
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
    /// Learns which MAC holds each address it hands out, for TFTP and HTTP timelines.
    pub neighbors: Arc<Neighbors>,
}

pub struct DhcpServer {
    ctx: Context,
    table: LeaseTable,
}

impl DhcpServer {
    pub fn new(ctx: Context, table: LeaseTable) -> Self {
        Self { ctx, table }
    }

    pub fn table(&self) -> &LeaseTable {
        &self.table
    }

    /// Handles one datagram received on `port` from `from`.
    pub fn handle(
        &mut self,
        bytes: &[u8],
        from: SocketAddrV4,
        port: Port,
        now: UnixTime,
    ) -> Outcome {
        let Some(msg) = decode(bytes) else {
            self.ctx
                .metrics
                .dhcp_dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(%from, len = bytes.len(), "dropping a datagram that is not a DHCP request");
            return Outcome::default();
        };
        let Some(client) = BootClient::from_message(&msg) else {
            self.ctx
                .metrics
                .dhcp_dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(%from, htype = ?msg.htype(), hlen = msg.hlen(), "dropping a request from a non-Ethernet client");
            return Outcome::default();
        };
        let msg_type = msg
            .opts()
            .msg_type()
            .expect("decode checked the message type");
        self.ctx.metrics.dhcp_received(msg_type);
        self.table.sweep(now);
        let outcome = match (self.ctx.mode, port) {
            (DhcpMode::Off, _) => Outcome::default(),
            (_, Port::Pxe) => self.boot_server(&msg, &client, from),
            (DhcpMode::Proxy, Port::Dhcp) => self.proxy(&msg, &client),
            (DhcpMode::Full, Port::Dhcp) => self.full(&msg, msg_type, &client, now),
        };
        if let Some(reply) = &outcome.reply
            && let Some(t) = decode_type(&reply.bytes)
        {
            self.ctx.metrics.dhcp_sent(t);
        }
        outcome
    }

    fn answer(&self, client: &BootClient) -> Answer {
        let known = self.ctx.inventory.boots(client.mac);
        decision::answer(
            self.ctx.mode,
            client,
            known,
            &self.ctx.binaries,
            &self.ctx.endpoints,
        )
    }

    fn record(&self, mac: MacAddr, stage: Stage, detail: String) {
        self.ctx.timeline.record(mac, stage, detail);
    }

    // ----- full mode -----

    fn full(
        &mut self,
        msg: &Message,
        msg_type: MessageType,
        client: &BootClient,
        now: UnixTime,
    ) -> Outcome {
        let mac = client.mac;
        let Some(subnet) = self.table.plan().subnet_for(msg.giaddr()) else {
            tracing::warn!(%mac, giaddr = %msg.giaddr(), "no configured subnet for this request; ignoring it");
            return Outcome::default();
        };
        match msg_type {
            MessageType::Discover => self.discover(msg, client, subnet, now),
            MessageType::Request => self.request(msg, client, subnet, now),
            MessageType::Decline => self.decline(msg, mac, now),
            MessageType::Release => self.release(msg, mac, now),
            MessageType::Inform => self.inform(msg, client, subnet),
            other => {
                tracing::debug!(%mac, message = ?other, "ignoring a message type servers do not answer");
                Outcome::default()
            }
        }
    }

    fn discover(
        &mut self,
        msg: &Message,
        client: &BootClient,
        subnet: usize,
        now: UnixTime,
    ) -> Outcome {
        let mac = client.mac;
        self.record(mac, Stage::DhcpDiscover, describe_client(client));
        let Some(addr) = self.table.choose(mac, subnet, requested_address(msg), now) else {
            tracing::warn!(%mac, subnet = %self.table.plan().subnets[subnet].subnet, "no free address to offer: the pool is exhausted");
            return Outcome::default();
        };
        self.table.offer(mac, addr, now + OFFER_HOLD_SECS);
        let answer = self.answer(client);
        let reply = self.lease_reply(msg, MessageType::Offer, addr, subnet, client, &answer);
        self.record(
            mac,
            Stage::DhcpOffer,
            format!("{addr} {}", describe_answer(&answer)),
        );
        Outcome {
            reply: Some(reply),
            record: None,
        }
    }

    fn request(
        &mut self,
        msg: &Message,
        client: &BootClient,
        subnet: usize,
        now: UnixTime,
    ) -> Outcome {
        let mac = client.mac;
        let server = self.ctx.endpoints.address;
        let server_id = server_identifier(msg);
        if server_id.is_some_and(|id| id != server) {
            // The client chose another server's offer.
            self.table.cancel_offer(mac);
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
        let plan = &self.table.plan().subnets[subnet];
        if !plan.subnet.is_host(addr) {
            return self.nak(msg, mac, &format!("{addr} is not on this network"));
        }
        if let Some(r) = self.table.plan().reservation_for(mac)
            && plan.subnet.contains(r.address)
            && r.address != addr
        {
            return self.nak(msg, mac, &format!("{mac} is reserved {}", r.address));
        }
        let reserved_for_mac = self
            .table
            .plan()
            .reservation_for(mac)
            .is_some_and(|r| r.address == addr);
        let ours = self.table.lease(addr).is_some_and(|l| l.mac == mac);
        if !(reserved_for_mac || ours || plan.in_pool(addr)) {
            return self.nak(msg, mac, &format!("{addr} is not in a pool"));
        }
        if !self.table.available_to(addr, mac, now) {
            return self.nak(msg, mac, &format!("{addr} belongs to another client"));
        }
        let lease_secs = plan.lease_time.as_secs();
        let hostname = self
            .table
            .plan()
            .reservation_for(mac)
            .and_then(|r| r.hostname.clone());
        let record = self.table.bind(Lease {
            addr,
            mac,
            expires: now + lease_secs,
            hostname,
        });
        self.ctx.neighbors.learn(addr, mac);
        let answer = self.answer(client);
        let reply = self.lease_reply(msg, MessageType::Ack, addr, subnet, client, &answer);
        self.record(
            mac,
            Stage::DhcpAck,
            format!("{addr} for {lease_secs}s {}", describe_answer(&answer)),
        );
        Outcome {
            reply: Some(reply),
            record: Some(record),
        }
    }

    fn decline(&mut self, msg: &Message, mac: MacAddr, now: UnixTime) -> Outcome {
        let Some(addr) = requested_address(msg) else {
            return Outcome::default();
        };
        if server_identifier(msg) != Some(self.ctx.endpoints.address) {
            return Outcome::default();
        }
        let until = now + self.table.plan().decline_quarantine.as_secs();
        let record = self.table.decline(mac, addr, until);
        if record.is_some() {
            tracing::warn!(%mac, %addr, "client declined the address (in use by someone else?); quarantined");
            self.record(mac, Stage::DhcpDecline, format!("{addr} quarantined"));
        }
        Outcome {
            reply: None,
            record,
        }
    }

    fn release(&mut self, msg: &Message, mac: MacAddr, now: UnixTime) -> Outcome {
        if server_identifier(msg).is_some_and(|id| id != self.ctx.endpoints.address) {
            return Outcome::default();
        }
        let addr = msg.ciaddr();
        let record = self.table.release(mac, addr, now);
        if record.is_some() {
            self.record(mac, Stage::DhcpRelease, format!("{addr}"));
        }
        Outcome {
            reply: None,
            record,
        }
    }

    fn inform(&mut self, msg: &Message, client: &BootClient, subnet: usize) -> Outcome {
        let mut reply = base_reply(msg, MessageType::Ack, self.ctx.endpoints.address);
        add_network_options(&mut reply, &self.table.plan().subnets[subnet], None);
        if let Answer::Boot(offer) = self.answer(client) {
            add_boot_options(&mut reply, &offer, client, self.ctx.endpoints.address);
        }
        let to = destination(msg, MessageType::Ack);
        Outcome {
            reply: Some(Reply {
                bytes: encode(&reply),
                to,
            }),
            record: None,
        }
    }

    fn lease_reply(
        &self,
        msg: &Message,
        t: MessageType,
        addr: Ipv4Addr,
        subnet: usize,
        client: &BootClient,
        answer: &Answer,
    ) -> Reply {
        let server = self.ctx.endpoints.address;
        let plan = &self.table.plan().subnets[subnet];
        let mut reply = base_reply(msg, t, server);
        reply.set_yiaddr(addr);
        let hostname = self
            .table
            .plan()
            .reservation_for(client.mac)
            .and_then(|r| r.hostname.as_deref());
        add_network_options(&mut reply, plan, hostname);
        let secs = u32::try_from(plan.lease_time.as_secs()).unwrap_or(u32::MAX);
        let opts = reply.opts_mut();
        opts.insert(DhcpOption::AddressLeaseTime(secs));
        opts.insert(DhcpOption::Renewal(secs / 2));
        opts.insert(DhcpOption::Rebinding(secs / 8 * 7));
        if let Answer::Boot(offer) = answer {
            add_boot_options(&mut reply, offer, client, server);
        }
        Reply {
            bytes: encode(&reply),
            to: destination(msg, t),
        }
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
        Outcome {
            reply: Some(Reply {
                bytes: encode(&reply),
                to,
            }),
            record: None,
        }
    }

    // ----- proxy mode and the PXE boot server -----

    /// Port 67 in proxy mode: boot information for PXE clients' DISCOVERs; the site's DHCP
    /// server does the rest.
    fn proxy(&mut self, msg: &Message, client: &BootClient) -> Outcome {
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
        Outcome {
            reply: Some(Reply {
                bytes: encode(&reply),
                to,
            }),
            record: None,
        }
    }

    /// Port 4011: a PXE client asking the boot server directly (unicast, it has an address).
    fn boot_server(&mut self, msg: &Message, client: &BootClient, from: SocketAddrV4) -> Outcome {
        if !matches!(
            msg.opts().msg_type(),
            Some(MessageType::Request | MessageType::Inform)
        ) {
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
        self.ctx.neighbors.learn(*from.ip(), client.mac);
        self.record(client.mac, Stage::ProxyAck, offer.boot_file().to_owned());
        Outcome {
            reply: Some(Reply {
                bytes: encode(&reply),
                to: from,
            }),
            record: None,
        }
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
            reply
                .opts_mut()
                .insert(DhcpOption::ClientMachineIdentifier(id.clone()));
        }
        reply
    }
}

/// Decodes a BOOTREQUEST with the DHCP magic cookie and a message type; anything else is not
/// for us.
fn decode(bytes: &[u8]) -> Option<Message> {
    if bytes.get(236..240) != Some(&MAGIC_COOKIE[..]) {
        return None;
    }
    let msg = Message::decode(&mut Decoder::new(bytes)).ok()?;
    (msg.opcode() == Opcode::BootRequest && msg.opts().msg_type().is_some()).then_some(msg)
}

fn decode_type(bytes: &[u8]) -> Option<MessageType> {
    Message::decode(&mut Decoder::new(bytes))
        .ok()?
        .opts()
        .msg_type()
}

fn encode(msg: &Message) -> Vec<u8> {
    let mut buf = Vec::with_capacity(MIN_REPLY_LEN);
    msg.encode(&mut Encoder::new(&mut buf))
        .expect("encoding into a Vec cannot fail");
    if buf.len() < MIN_REPLY_LEN {
        buf.resize(MIN_REPLY_LEN, 0);
    }
    buf
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
    reply
        .opts_mut()
        .insert(DhcpOption::ServerIdentifier(server));
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
    reply
        .opts_mut()
        .insert(DhcpOption::BootfileName(file.as_bytes().to_vec()));
    match offer {
        BootOffer::Tftp { .. } => {
            reply.set_siaddr(server);
            reply
                .opts_mut()
                .insert(DhcpOption::TFTPServerName(server.to_string().into_bytes()));
        }
        BootOffer::HttpBoot { .. } => {
            // UEFI HTTP boot ignores offers that do not echo its vendor class.
            reply
                .opts_mut()
                .insert(DhcpOption::ClassIdentifier(HTTP_CLIENT.to_vec()));
        }
        BootOffer::Script { .. } => {}
    }
    if client.firmware_boot && !matches!(offer, BootOffer::HttpBoot { .. }) {
        // EDK2 and PXE ROMs treat an offer without "PXEClient" as carrying no boot server.
        reply
            .opts_mut()
            .insert(DhcpOption::ClassIdentifier(PXE_CLIENT.to_vec()));
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
    format!(
        "arch={arch} ipxe={} firmware-boot={}",
        c.ipxe, c.firmware_boot
    )
}

fn describe_answer(a: &Answer) -> String {
    match a {
        Answer::Boot(offer) => format!("boot={}", offer.boot_file()),
        Answer::AddressOnly(reason) => format!("no boot: {reason}"),
        Answer::Ignore => "no boot".to_owned(),
    }
}
