//! Counters for `/metrics`, in the Prometheus text format. Plain atomics: the hot paths only add.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use dhcproto::v4::MessageType;
use serde::Serialize;

use crate::timeline::Timeline;

const DHCP_TYPES: [&str; 9] =
    ["discover", "offer", "request", "decline", "ack", "nak", "release", "inform", "other"];

fn dhcp_type_index(t: MessageType) -> usize {
    match t {
        MessageType::Discover => 0,
        MessageType::Offer => 1,
        MessageType::Request => 2,
        MessageType::Decline => 3,
        MessageType::Ack => 4,
        MessageType::Nak => 5,
        MessageType::Release => 6,
        MessageType::Inform => 7,
        _ => 8,
    }
}

/// The HTTP routes counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpRoute {
    Script,
    File,
    /// An image of the image cache.
    Image,
    IpxeBinary,
    Report,
    Agent,
    /// The boot media (virtual media, HTTPS).
    Media,
    Timeline,
    Health,
    Ready,
    Metrics,
    /// The status page and its assets.
    StatusPage,
    /// The status page's event stream.
    StatusEvents,
    NotFound,
}

impl HttpRoute {
    const ALL: [HttpRoute; 14] = [
        HttpRoute::Script,
        HttpRoute::File,
        HttpRoute::Image,
        HttpRoute::IpxeBinary,
        HttpRoute::Report,
        HttpRoute::Agent,
        HttpRoute::Media,
        HttpRoute::Timeline,
        HttpRoute::Health,
        HttpRoute::Ready,
        HttpRoute::Metrics,
        HttpRoute::StatusPage,
        HttpRoute::StatusEvents,
        HttpRoute::NotFound,
    ];

    fn as_str(self) -> &'static str {
        match self {
            HttpRoute::Script => "script",
            HttpRoute::File => "file",
            HttpRoute::Image => "image",
            HttpRoute::IpxeBinary => "ipxe-binary",
            HttpRoute::Report => "report",
            HttpRoute::Agent => "agent",
            HttpRoute::Media => "media",
            HttpRoute::Timeline => "timeline",
            HttpRoute::Health => "health",
            HttpRoute::Ready => "ready",
            HttpRoute::Metrics => "metrics",
            HttpRoute::StatusPage => "status-page",
            HttpRoute::StatusEvents => "status-events",
            HttpRoute::NotFound => "not-found",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why a relayed DHCP message (one with `giaddr` set) was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayRefusal {
    /// Its `giaddr` is not in `dhcp.trusted_relays`.
    UntrustedRelay,
    /// Its `giaddr` is a trusted relay's, but it came from an address that relay does not
    /// send from.
    UnexpectedSource,
    /// Its MAC's host is pinned to relay agent information (option 82) the relay did not say.
    RelayAgentMismatch,
}

impl RelayRefusal {
    const ALL: [RelayRefusal; 3] = [
        RelayRefusal::UntrustedRelay,
        RelayRefusal::UnexpectedSource,
        RelayRefusal::RelayAgentMismatch,
    ];

    fn as_str(self) -> &'static str {
        match self {
            RelayRefusal::UntrustedRelay => "untrusted-relay",
            RelayRefusal::UnexpectedSource => "unexpected-source",
            RelayRefusal::RelayAgentMismatch => "relay-agent-mismatch",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why an HTTP request was refused before it was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpRefusal {
    /// A request other than a boot script, an iPXE binary, `/healthz` or `/readyz` on a
    /// reserved slot.
    ReservedSlot,
    /// A boot report for a MAC the sender does not hold.
    ReportNotHolder,
    /// A boot report over the sender's rate.
    ReportRate,
    /// The agent API asked for over plain HTTP.
    AgentOverHttp,
    /// The boot media asked for over plain HTTP.
    MediaOverHttp,
}

impl HttpRefusal {
    const ALL: [HttpRefusal; 5] = [
        HttpRefusal::ReservedSlot,
        HttpRefusal::ReportNotHolder,
        HttpRefusal::ReportRate,
        HttpRefusal::AgentOverHttp,
        HttpRefusal::MediaOverHttp,
    ];

    fn as_str(self) -> &'static str {
        match self {
            HttpRefusal::ReservedSlot => "reserved-slot",
            HttpRefusal::ReportNotHolder => "report-not-holder",
            HttpRefusal::ReportRate => "report-rate",
            HttpRefusal::AgentOverHttp => "agent-over-http",
            HttpRefusal::MediaOverHttp => "media-over-http",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The counters the status page shows: those of `/metrics`, summed over their labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Headline {
    pub dhcp_received: u64,
    pub dhcp_sent: u64,
    pub dhcp_leases: u64,
    pub tftp_active: u64,
    pub tftp_completed: u64,
    pub tftp_failed: u64,
    pub http_connections_active: u64,
    pub http_requests: u64,
    pub http_bytes: u64,
    pub boot_steps: u64,
}

#[derive(Default)]
pub struct Metrics {
    dhcp_received: [AtomicU64; DHCP_TYPES.len()],
    dhcp_sent: [AtomicU64; DHCP_TYPES.len()],
    /// Datagrams that did not decode as DHCP, or were not for us.
    pub dhcp_dropped: AtomicU64,
    /// Bound, unexpired leases (a gauge, set by the DHCP server).
    pub dhcp_leases: AtomicU64,
    /// DECLINEs that quarantined nothing: a known host's or a reserved address, a MAC past
    /// its budget, or half the pool quarantined already.
    pub dhcp_declines_ignored: AtomicU64,
    /// RELEASEs that ended no lease: not sent from the released address, or a known host's
    /// or a reserved address (those leases run until they expire).
    pub dhcp_releases_ignored: AtomicU64,
    dhcp_relayed_dropped: [AtomicU64; RelayRefusal::ALL.len()],
    pub tftp_started: AtomicU64,
    pub tftp_completed: AtomicU64,
    pub tftp_failed: AtomicU64,
    /// Requests refused: write requests, missing files, paths outside the root, over the cap.
    pub tftp_refused: AtomicU64,
    pub tftp_evicted: AtomicU64,
    pub tftp_bytes: AtomicU64,
    pub tftp_active: AtomicU64,
    http_requests: [AtomicU64; HttpRoute::ALL.len()],
    http_refused: [AtomicU64; HttpRefusal::ALL.len()],
    pub http_bytes: AtomicU64,
    /// Connections being served (a gauge).
    pub http_connections_active: AtomicU64,
    /// Connections closed on arrival: their address already held its share, or every slot
    /// was taken.
    pub http_connections_refused: AtomicU64,
    /// Connections of unknown addresses closed to give their slot to a known host's.
    pub http_connections_evicted: AtomicU64,
    /// Failed `accept()` calls (out of file descriptors, ...), each followed by a backoff.
    pub http_accept_errors: AtomicU64,
    /// Connections and requests cut off by a deadline.
    pub http_timeouts: AtomicU64,
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn dhcp_received(&self, t: MessageType) {
        self.dhcp_received[dhcp_type_index(t)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn dhcp_sent(&self, t: MessageType) {
        self.dhcp_sent[dhcp_type_index(t)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn dhcp_relayed_dropped(&self, why: RelayRefusal) {
        self.dhcp_relayed_dropped[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn http_request(&self, route: HttpRoute) {
        self.http_requests[route.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn http_refused(&self, why: HttpRefusal) {
        self.http_refused[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// [`Headline`] now, with the boot steps counted by `timeline`.
    pub fn headline(&self, timeline: &Timeline) -> Headline {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let sum = |cs: &[AtomicU64]| cs.iter().map(get).sum();
        Headline {
            dhcp_received: sum(&self.dhcp_received),
            dhcp_sent: sum(&self.dhcp_sent),
            dhcp_leases: get(&self.dhcp_leases),
            tftp_active: get(&self.tftp_active),
            tftp_completed: get(&self.tftp_completed),
            tftp_failed: get(&self.tftp_failed),
            http_connections_active: get(&self.http_connections_active),
            http_requests: sum(&self.http_requests),
            http_bytes: get(&self.http_bytes),
            boot_steps: timeline.stage_counts().map(|(_, n)| n).sum(),
        }
    }

    /// The Prometheus text exposition of every counter, plus boots by stage from `timeline`.
    pub fn render(&self, timeline: &Timeline) -> String {
        let mut out = String::new();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);

        header(
            &mut out,
            "siteboot_dhcp_messages_total",
            "counter",
            "DHCP messages by direction and type.",
        );
        for (direction, counters) in [("received", &self.dhcp_received), ("sent", &self.dhcp_sent)]
        {
            for (name, c) in DHCP_TYPES.iter().zip(counters.iter()) {
                let _ = writeln!(
                    out,
                    "siteboot_dhcp_messages_total{{direction=\"{direction}\",type=\"{name}\"}} {}",
                    get(c)
                );
            }
        }
        let scalars: [(&str, &str, &str, &AtomicU64); 17] = [
            (
                "siteboot_dhcp_dropped_total",
                "counter",
                "Datagrams on the DHCP ports that were malformed or not for this server.",
                &self.dhcp_dropped,
            ),
            ("siteboot_dhcp_leases", "gauge", "Bound, unexpired DHCP leases.", &self.dhcp_leases),
            (
                "siteboot_dhcp_declines_ignored_total",
                "counter",
                "DHCPDECLINEs that quarantined no address: a known host's or reserved address, a MAC past its budget, or half the pool quarantined already.",
                &self.dhcp_declines_ignored,
            ),
            (
                "siteboot_dhcp_releases_ignored_total",
                "counter",
                "DHCPRELEASEs that ended no lease: not sent from the released address, or a known host's or reserved address.",
                &self.dhcp_releases_ignored,
            ),
            (
                "siteboot_tftp_transfers_started_total",
                "counter",
                "TFTP read transfers started.",
                &self.tftp_started,
            ),
            (
                "siteboot_tftp_transfers_completed_total",
                "counter",
                "TFTP read transfers completed.",
                &self.tftp_completed,
            ),
            (
                "siteboot_tftp_transfers_failed_total",
                "counter",
                "TFTP transfers aborted (timeouts, client errors, evictions).",
                &self.tftp_failed,
            ),
            (
                "siteboot_tftp_requests_refused_total",
                "counter",
                "TFTP requests refused (writes, missing files, paths outside the root, over the transfer caps).",
                &self.tftp_refused,
            ),
            (
                "siteboot_tftp_transfers_evicted_total",
                "counter",
                "TFTP transfers of unknown addresses ended to give their slot to a known host's (the oldest first).",
                &self.tftp_evicted,
            ),
            (
                "siteboot_tftp_bytes_total",
                "counter",
                "File bytes sent over TFTP (first transmissions).",
                &self.tftp_bytes,
            ),
            (
                "siteboot_tftp_transfers_active",
                "gauge",
                "TFTP transfers in progress.",
                &self.tftp_active,
            ),
            (
                "siteboot_http_bytes_total",
                "counter",
                "Body bytes sent over HTTP.",
                &self.http_bytes,
            ),
            (
                "siteboot_http_connections_active",
                "gauge",
                "HTTP connections being served.",
                &self.http_connections_active,
            ),
            (
                "siteboot_http_connections_refused_total",
                "counter",
                "HTTP connections closed on arrival: their address held http.max_connections_per_address, or every slot was taken.",
                &self.http_connections_refused,
            ),
            (
                "siteboot_http_connections_evicted_total",
                "counter",
                "HTTP connections of unknown addresses closed to give their slot to a known host's (the oldest first).",
                &self.http_connections_evicted,
            ),
            (
                "siteboot_http_accept_errors_total",
                "counter",
                "Failed accepts of HTTP connections (e.g. out of file descriptors); each is retried after a backoff.",
                &self.http_accept_errors,
            ),
            (
                "siteboot_http_timeouts_total",
                "counter",
                "HTTP connections or requests cut off by a deadline (headers, agent body, a client that stopped reading).",
                &self.http_timeouts,
            ),
        ];
        for (name, kind, help, counter) in scalars {
            header(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {}", get(counter));
        }
        header(
            &mut out,
            "siteboot_dhcp_relayed_dropped_total",
            "counter",
            "Relayed DHCP messages dropped: their giaddr is not in dhcp.trusted_relays, they came from an address that relay does not send from, or their MAC's host is pinned to relay agent information (option 82) the relay did not say.",
        );
        for why in RelayRefusal::ALL {
            let _ = writeln!(
                out,
                "siteboot_dhcp_relayed_dropped_total{{reason=\"{}\"}} {}",
                why.as_str(),
                get(&self.dhcp_relayed_dropped[why.index()])
            );
        }
        header(&mut out, "siteboot_http_requests_total", "counter", "HTTP requests by route.");
        for route in HttpRoute::ALL {
            let _ = writeln!(
                out,
                "siteboot_http_requests_total{{route=\"{}\"}} {}",
                route.as_str(),
                get(&self.http_requests[route.index()])
            );
        }
        header(
            &mut out,
            "siteboot_http_requests_refused_total",
            "counter",
            "HTTP requests refused before they were served, by reason.",
        );
        for why in HttpRefusal::ALL {
            let _ = writeln!(
                out,
                "siteboot_http_requests_refused_total{{reason=\"{}\"}} {}",
                why.as_str(),
                get(&self.http_refused[why.index()])
            );
        }
        header(&mut out, "siteboot_boot_steps_total", "counter", "Boot steps recorded, by stage.");
        for (stage, count) in timeline.stage_counts() {
            let _ =
                writeln!(out, "siteboot_boot_steps_total{{stage=\"{}\"}} {count}", stage.as_str());
        }
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::Stage;

    #[test]
    fn the_headline_sums_what_metrics_splits_by_label() {
        let metrics = Metrics::new();
        let timeline = Timeline::new();
        metrics.dhcp_received(MessageType::Discover);
        metrics.dhcp_received(MessageType::Request);
        metrics.dhcp_sent(MessageType::Offer);
        metrics.http_request(HttpRoute::Script);
        metrics.http_request(HttpRoute::StatusEvents);
        Metrics::add(&metrics.http_bytes, 1000);
        Metrics::add(&metrics.tftp_failed, 2);
        let mac = "52:54:00:00:00:01".parse().unwrap();
        timeline.record(mac, Stage::DhcpDiscover, "");
        timeline.record(mac, Stage::Report, "");
        let headline = metrics.headline(&timeline);
        assert_eq!((headline.dhcp_received, headline.dhcp_sent), (2, 1));
        assert_eq!((headline.http_requests, headline.http_bytes), (2, 1000));
        assert_eq!((headline.tftp_failed, headline.boot_steps), (2, 2));
        let text = metrics.render(&timeline);
        assert!(text.contains("siteboot_http_requests_total{route=\"status-events\"} 1"), "{text}");
    }
}
