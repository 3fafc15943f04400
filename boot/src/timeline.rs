//! Per-MAC boot timelines: every boot step is logged with the MAC and kept, bounded, for
//! `GET /timeline/<mac>`, counted for `/metrics`, and broadcast to live views (the status
//! page's event stream).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use serde::Serialize;
use tokio::sync::broadcast;

use crate::MacAddr;

/// A step of a network boot, in the order a host usually goes through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Stage {
    DhcpDiscover,
    DhcpOffer,
    DhcpRequest,
    DhcpAck,
    DhcpNak,
    DhcpDecline,
    DhcpRelease,
    ProxyOffer,
    ProxyAck,
    TftpStart,
    TftpDone,
    TftpFailed,
    IpxeScript,
    HttpFile,
    Report,
}

impl Stage {
    pub const ALL: [Stage; 15] = [
        Stage::DhcpDiscover,
        Stage::DhcpOffer,
        Stage::DhcpRequest,
        Stage::DhcpAck,
        Stage::DhcpNak,
        Stage::DhcpDecline,
        Stage::DhcpRelease,
        Stage::ProxyOffer,
        Stage::ProxyAck,
        Stage::TftpStart,
        Stage::TftpDone,
        Stage::TftpFailed,
        Stage::IpxeScript,
        Stage::HttpFile,
        Stage::Report,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::DhcpDiscover => "dhcp-discover",
            Stage::DhcpOffer => "dhcp-offer",
            Stage::DhcpRequest => "dhcp-request",
            Stage::DhcpAck => "dhcp-ack",
            Stage::DhcpNak => "dhcp-nak",
            Stage::DhcpDecline => "dhcp-decline",
            Stage::DhcpRelease => "dhcp-release",
            Stage::ProxyOffer => "proxy-offer",
            Stage::ProxyAck => "proxy-ack",
            Stage::TftpStart => "tftp-start",
            Stage::TftpDone => "tftp-done",
            Stage::TftpFailed => "tftp-failed",
            Stage::IpxeScript => "ipxe-script",
            Stage::HttpFile => "http-file",
            Stage::Report => "report",
        }
    }

    fn index(self) -> usize {
        Stage::ALL.iter().position(|s| *s == self).expect("ALL lists every stage")
    }
}

/// Serialized with `at` (RFC 3339, UTC) beside `at_ms`; the string is made only when an event
/// is read, not on the DHCP path that records it.
#[derive(Debug, Clone)]
pub struct Event {
    /// Milliseconds since the Unix epoch, for computing durations.
    pub at_ms: u64,
    pub stage: Stage,
    pub detail: String,
}

impl Serialize for Event {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("Event", 4)?;
        s.serialize_field("at", &rfc3339(self.at_ms))?;
        s.serialize_field("at_ms", &self.at_ms)?;
        s.serialize_field("stage", &self.stage)?;
        s.serialize_field("detail", &self.detail)?;
        s.end()
    }
}

/// A step as it was recorded, for live views.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub mac: MacAddr,
    pub event: Event,
}

/// Limits that keep memory bounded whatever clients do.
const MAX_HOSTS: usize = 4096;
const MAX_EVENTS_PER_HOST: usize = 128;
/// Steps a live view may fall behind by before it misses some (and is told so, see
/// [`broadcast::error::RecvError::Lagged`]): recording never waits for a viewer.
const LIVE_BACKLOG: usize = 1024;

#[derive(Default)]
struct Inner {
    hosts: HashMap<MacAddr, Host>,
    /// Last-update sequence number -> MAC, to evict the least recently active host.
    by_recency: BTreeMap<u64, MacAddr>,
    next_seq: u64,
}

struct Host {
    seq: u64,
    events: VecDeque<Event>,
}

pub struct Timeline {
    inner: Mutex<Inner>,
    stage_counts: [AtomicU64; Stage::ALL.len()],
    live: broadcast::Sender<Recorded>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            stage_counts: Default::default(),
            live: broadcast::Sender::new(LIVE_BACKLOG),
        }
    }
}

impl Timeline {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every step recorded from now on. A receiver that falls more than [`LIVE_BACKLOG`]
    /// steps behind loses the oldest and is told how many.
    pub fn subscribe(&self) -> broadcast::Receiver<Recorded> {
        self.live.subscribe()
    }

    /// Records a boot step: logs it, keeps it in the MAC's timeline and counts it.
    pub fn record(&self, mac: MacAddr, stage: Stage, detail: impl Into<String>) {
        let detail = detail.into();
        tracing::info!(%mac, stage = stage.as_str(), "{detail}");
        self.stage_counts[stage.index()].fetch_add(1, Ordering::Relaxed);
        let at_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let event = Event { at_ms, stage, detail };
        if self.live.receiver_count() > 0 {
            // Never blocks: a viewer that falls behind loses steps, not the recorder.
            let _ = self.live.send(Recorded { mac, event: event.clone() });
        }

        let mut inner = self.inner.lock().expect("timeline lock");
        let seq = inner.next_seq;
        inner.next_seq += 1;
        if !inner.hosts.contains_key(&mac)
            && inner.hosts.len() >= MAX_HOSTS
            && let Some((_, oldest)) = inner.by_recency.pop_first()
        {
            inner.hosts.remove(&oldest);
        }
        let host = inner.hosts.entry(mac).or_insert_with(|| Host { seq, events: VecDeque::new() });
        let previous = std::mem::replace(&mut host.seq, seq);
        if host.events.len() >= MAX_EVENTS_PER_HOST {
            host.events.pop_front();
        }
        host.events.push_back(event);
        inner.by_recency.remove(&previous);
        inner.by_recency.insert(seq, mac);
    }

    /// The events recorded for `mac`, oldest first.
    pub fn events(&self, mac: MacAddr) -> Vec<Event> {
        let inner = self.inner.lock().expect("timeline lock");
        inner.hosts.get(&mac).map(|h| h.events.iter().cloned().collect()).unwrap_or_default()
    }

    /// MACs with a timeline, most recently active first.
    pub fn hosts(&self) -> Vec<MacAddr> {
        let inner = self.inner.lock().expect("timeline lock");
        inner.by_recency.values().rev().copied().collect()
    }

    /// `(stage, count)` for every stage, for `/metrics`.
    pub fn stage_counts(&self) -> impl Iterator<Item = (Stage, u64)> + '_ {
        Stage::ALL.iter().map(|s| (*s, self.stage_counts[s.index()].load(Ordering::Relaxed)))
    }
}

/// RFC 3339 UTC with milliseconds, without pulling in a date crate.
fn rfc3339(at_ms: u64) -> String {
    let (secs, millis) = (at_ms / 1000, at_ms % 1000);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        millis
    )
}

/// Howard Hinnant's days-to-civil algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339(1_764_693_296_123), "2025-12-02T16:34:56.123Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        let event = Event { at_ms: 1_764_693_296_123, stage: Stage::Report, detail: "x".into() };
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            serde_json::json!({"at": "2025-12-02T16:34:56.123Z", "at_ms": 1_764_693_296_123u64, "stage": "report", "detail": "x"})
        );
    }

    #[test]
    fn bounded_per_host_and_in_hosts() {
        let tl = Timeline::new();
        let mac: MacAddr = "52:54:00:00:00:01".parse().unwrap();
        for i in 0..(MAX_EVENTS_PER_HOST + 10) {
            tl.record(mac, Stage::DhcpDiscover, format!("{i}"));
        }
        let events = tl.events(mac);
        assert_eq!(events.len(), MAX_EVENTS_PER_HOST);
        assert_eq!(events[0].detail, "10");
        for i in 0..(MAX_HOSTS as u32 + 5) {
            let b = i.to_be_bytes();
            tl.record(MacAddr::new([2, 0, b[0], b[1], b[2], b[3]]), Stage::Report, "x");
        }
        assert_eq!(tl.hosts().len(), MAX_HOSTS);
        assert!(tl.events(mac).is_empty(), "the least recently active host was evicted");
        let counts: HashMap<Stage, u64> = tl.stage_counts().collect();
        assert_eq!(counts[&Stage::DhcpDiscover], MAX_EVENTS_PER_HOST as u64 + 10);
    }

    #[test]
    fn live_views_see_each_step_and_a_slow_one_never_holds_recording_up() {
        let tl = Timeline::new();
        let mac: MacAddr = "52:54:00:00:00:01".parse().unwrap();
        tl.record(mac, Stage::DhcpDiscover, "before anyone watched");
        let mut live = tl.subscribe();
        tl.record(mac, Stage::IpxeScript, "kernel x");
        let seen = live.try_recv().unwrap();
        assert_eq!(
            (seen.mac, seen.event.stage, seen.event.detail.as_str()),
            (mac, Stage::IpxeScript, "kernel x")
        );
        for i in 0..LIVE_BACKLOG + 5 {
            tl.record(mac, Stage::HttpFile, format!("{i}"));
        }
        assert_eq!(live.try_recv().unwrap_err(), broadcast::error::TryRecvError::Lagged(5));
        assert_eq!(live.try_recv().unwrap().event.detail, "5", "the oldest steps were dropped");
    }
}
