//! The status page a site operator watches, on the plain HTTP port, read-only:
//!
//! - `GET /`: the page, with its script and style at `/status/app.js` and `/status/style.css`
//!   (compiled into the binary; the page loads nothing from anywhere else);
//! - `GET /status/events`: the server-sent events the page follows. First `snapshot`: the
//!   site, this appliance's health (leader or standby, ready, counters) and every host with its
//!   boot chart; then `step` for each boot step recorded, `host` when a host's summary
//!   changes, `gone` when it leaves the inventory, and `health` when the health changes.
//!
//! Every machine on the provisioning segment can reach this port, so the page shows only what
//! is listed above: no tokens or operation ids (timeline details have them redacted), image
//! digests, bootstrap data, BMC addresses or credentials, and of a claim only that it exists. Host names and step details may be chosen by a client (a file
//! name it asked for, say): they reach the page as JSON strings and are put into it as text,
//! under a Content-Security-Policy that allows no inline script.
//!
//! Recording a step never waits for a viewer: steps reach the streams through a bounded
//! broadcast; a stream that falls behind sends a fresh snapshot instead, and one whose client
//! stops reading is dropped (the browser reconnects and starts from a snapshot). At most
//! [`MAX_STREAMS`] streams are open at once, [`MAX_STREAMS_PER_ADDRESS`] per client address.

mod chart;

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Frame;
use serde::Serialize;
use tokio::sync::{broadcast, mpsc};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::{Body, full, text};
use crate::admission::{Caps, Slots, Standing, Ticket};
use crate::inventory::HostSummary;
use crate::leadership::{Leadership, LeadershipWatch};
use crate::metrics::{Headline, HttpRoute};
use crate::timeline::{Event, Recorded, Stage};
use crate::{BootPlane, MacAddr};
use chart::{Segment, chart};

const INDEX_HTML: &str = include_str!("status_page/index.html");
const APP_JS: &str = include_str!("status_page/app.js");
const STYLE_CSS: &str = include_str!("status_page/style.css");

/// The page's own script and style, and its own event stream: nothing inline (an injected
/// `<script>` or `onerror=` would not run), nothing from elsewhere, no framing. `data:`
/// images only for the empty favicon, which saves a request that would fail.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// Event streams open at once, and per client address.
const MAX_STREAMS: usize = 32;
const MAX_STREAMS_PER_ADDRESS: usize = 4;
/// Frames queued for one client; a client this far behind is dropped.
const STREAM_QUEUE: usize = 256;
/// How often a stream looks for changed hosts and health.
const POLL: Duration = Duration::from_secs(1);
/// A comment goes out after this long without a frame, so a dead client is noticed.
const KEEPALIVE: Duration = Duration::from_secs(15);
/// How long the browser waits before it reconnects a dropped stream.
const RETRY: Duration = Duration::from_secs(3);
/// Hosts that are in the timeline but not the inventory, listed at most (the most recently
/// active): any machine on the segment can make MACs up.
const MAX_UNLISTED: usize = 256;
/// Characters of a step's detail sent (the whole detail is in `/timeline/<mac>`).
const MAX_DETAIL: usize = 300;

/// The page, for one appliance.
pub struct StatusPage {
    /// What the page calls this appliance's site.
    site: Arc<str>,
    leadership: LeadershipWatch,
    streams: Arc<Slots>,
    /// Cancelled when the server stops: streams never end by themselves.
    closed: CancellationToken,
}

impl StatusPage {
    pub fn new(site: impl Into<Arc<str>>, leadership: LeadershipWatch) -> Self {
        let caps = Caps::new(MAX_STREAMS, MAX_STREAMS_PER_ADDRESS, 0).expect("valid caps");
        Self {
            site: site.into(),
            leadership,
            streams: Slots::new(caps),
            closed: CancellationToken::new(),
        }
    }

    /// Ends every event stream (the server is stopping).
    pub(super) fn close(&self) {
        self.closed.cancel();
    }

    /// Answers `GET path` (`/` or `/status/...`).
    pub(super) fn respond(
        &self,
        plane: &BootPlane,
        path: &str,
        remote: IpAddr,
    ) -> (HttpRoute, Response<Body>) {
        let asset = |body: &'static str, content_type: &'static str| {
            let response = Response::builder()
                .header(header::CONTENT_TYPE, content_type)
                .header(header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY)
                .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff")
                .header(header::REFERRER_POLICY, "no-referrer")
                .header(header::CACHE_CONTROL, "no-cache")
                .body(full(body))
                .expect("valid response");
            (HttpRoute::StatusPage, response)
        };
        match path {
            "/" => asset(INDEX_HTML, "text/html; charset=utf-8"),
            "/status/app.js" => asset(APP_JS, "text/javascript; charset=utf-8"),
            "/status/style.css" => asset(STYLE_CSS, "text/css; charset=utf-8"),
            "/status/events" => (HttpRoute::StatusEvents, self.events(plane, remote)),
            _ => (HttpRoute::NotFound, text(StatusCode::NOT_FOUND, "not found\n")),
        }
    }

    fn events(&self, plane: &BootPlane, remote: IpAddr) -> Response<Body> {
        let ticket = match self.streams.admit(remote, Standing::Unknown) {
            Ok(ticket) => ticket,
            Err(refusal) => {
                let mut busy = text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("too many status page streams: {refusal}\n"),
                );
                busy.headers_mut()
                    .insert(header::RETRY_AFTER, header::HeaderValue::from_static("10"));
                return busy;
            }
        };
        let (frames, receiver) = mpsc::channel(STREAM_QUEUE);
        let view = View {
            plane: plane.clone(),
            site: self.site.clone(),
            leadership: self.leadership.clone(),
        };
        let stream = Stream { view, frames, last_sent: Instant::now(), _ticket: ticket };
        tokio::spawn(stream.run(self.closed.clone()));
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-store")
            .body(EventBody(receiver).boxed())
            .expect("valid response")
    }
}

/// What the page reads, cheap to clone into each stream.
#[derive(Clone)]
struct View {
    plane: BootPlane,
    site: Arc<str>,
    leadership: LeadershipWatch,
}

/// This appliance as the page shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct Health {
    role: Role,
    /// `/readyz`: whether the inventory can answer; if not, why.
    ready: bool,
    not_ready: Option<&'static str>,
    counters: Headline,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Role {
    /// Leads the site: answers full-mode DHCP and reconciles.
    Leader,
    /// Another replica leads (or none is known to); this one serves TFTP and HTTP.
    Standby,
    /// No election: standalone, or `leader_election: false`.
    OnlyReplica,
}

impl Role {
    fn of(leadership: &Leadership, now: tokio::time::Instant) -> Self {
        match leadership {
            Leadership::Always => Role::OnlyReplica,
            term if term.is_leading(now) => Role::Leader,
            _ => Role::Standby,
        }
    }
}

/// A host in a snapshot.
#[derive(Debug, Serialize)]
struct HostRow {
    #[serde(flatten)]
    host: HostSummary,
    /// In the inventory (not only seen in the timeline).
    listed: bool,
    chart: Vec<Segment>,
    /// Its latest step.
    last: Option<StepView>,
}

#[derive(Debug, Serialize)]
struct Snapshot<'a> {
    site: &'a str,
    health: Health,
    hosts: Vec<HostRow>,
    /// Hosts seen in the timeline but not in the inventory that were left out.
    unlisted_omitted: usize,
}

/// A boot step as the page shows it.
#[derive(Debug, Serialize)]
struct StepView {
    stage: Stage,
    at_ms: u64,
    /// Shortened to [`MAX_DETAIL`] characters.
    detail: String,
}

impl StepView {
    fn of(event: &Event) -> Self {
        let detail = event.detail.chars().take(MAX_DETAIL).collect();
        Self { stage: event.stage, at_ms: event.at_ms, detail }
    }
}

/// A boot step as the stream sends it, with the host's chart after it.
#[derive(Debug, Serialize)]
struct Step {
    mac: MacAddr,
    #[serde(flatten)]
    step: StepView,
    chart: Vec<Segment>,
}

#[derive(Debug, Serialize)]
struct Gone {
    mac: MacAddr,
}

/// The inventory's hosts by MAC.
type Listed = HashMap<MacAddr, HostSummary>;

impl View {
    fn health(&self) -> Health {
        let role = Role::of(&self.leadership.borrow(), tokio::time::Instant::now());
        let not_ready = self.plane.inventory.ready().err();
        Health {
            role,
            ready: not_ready.is_none(),
            not_ready,
            counters: self.plane.metrics.headline(&self.plane.timeline),
        }
    }

    /// The inventory's hosts, each with the address this appliance's DHCP leased it if any.
    fn listed(&self) -> Listed {
        self.plane
            .inventory
            .hosts()
            .into_iter()
            .map(|mut host| {
                host.address = self.plane.neighbors.leased_address(host.mac).or(host.address);
                (host.mac, host)
            })
            .collect()
    }

    fn snapshot(&self, listed: &Listed) -> Bytes {
        let timeline = &self.plane.timeline;
        let unlisted: Vec<MacAddr> =
            timeline.hosts().into_iter().filter(|mac| !listed.contains_key(mac)).collect();
        let unlisted_omitted = unlisted.len().saturating_sub(MAX_UNLISTED);
        let unlisted = unlisted.into_iter().take(MAX_UNLISTED).map(|mac| HostSummary {
            mac,
            name: None,
            state: "not listed".to_owned(),
            address: self.plane.neighbors.leased_address(mac),
            claim: None,
            operation: None,
        });
        let rows = listed
            .values()
            .map(|host| (host.clone(), true))
            .chain(unlisted.map(|host| (host, false)))
            .map(|(host, listed)| {
                let events = timeline.events(host.mac);
                HostRow {
                    listed,
                    chart: chart(&events),
                    last: events.last().map(StepView::of),
                    host,
                }
            })
            .collect();
        let snapshot =
            Snapshot { site: &self.site, health: self.health(), hosts: rows, unlisted_omitted };
        frame(SNAPSHOT, &snapshot)
    }

    fn step(&self, recorded: &Recorded) -> Bytes {
        let step = Step {
            mac: recorded.mac,
            step: StepView::of(&recorded.event),
            chart: chart(&self.plane.timeline.events(recorded.mac)),
        };
        frame(STEP, &step)
    }
}

/// The SSE event names.
const SNAPSHOT: &str = "snapshot";
const STEP: &str = "step";
const HOST: &str = "host";
const GONE: &str = "gone";
const HEALTH: &str = "health";

/// One server-sent event. JSON escapes every control character, so `data` is one line
/// whatever the strings in it: a detail cannot end the event or start another.
fn frame(event: &str, data: &impl Serialize) -> Bytes {
    let json = serde_json::to_string(data).expect("status page data serializes");
    Bytes::from(format!("event: {event}\ndata: {json}\n\n"))
}

/// Hosts whose summary changed or that are new in `now`, and the MACs `now` no longer has.
fn changes<'a>(before: &Listed, now: &'a Listed) -> (Vec<&'a HostSummary>, Vec<MacAddr>) {
    let changed = now.values().filter(|host| before.get(&host.mac) != Some(*host)).collect();
    let gone = before.keys().filter(|mac| !now.contains_key(mac)).copied().collect();
    (changed, gone)
}

/// One client's event stream.
struct Stream {
    view: View,
    frames: mpsc::Sender<Bytes>,
    last_sent: Instant,
    /// Its place under [`MAX_STREAMS`], given back when the stream ends.
    _ticket: Ticket,
}

/// Why a stream stopped sending.
enum Ended {
    /// The client went away.
    Closed,
    /// The client reads slower than the page changes.
    TooSlow,
}

impl Stream {
    async fn run(mut self, closed: CancellationToken) {
        match self.follow(closed).await {
            Ok(()) | Err(Ended::Closed) => {}
            Err(Ended::TooSlow) => tracing::debug!("dropped a status page stream that fell behind"),
        }
    }

    async fn follow(&mut self, closed: CancellationToken) -> Result<(), Ended> {
        // Subscribed before the snapshot is taken, so no step falls between the two.
        let mut live = self.view.plane.timeline.subscribe();
        self.send(Bytes::from(format!("retry: {}\n\n", RETRY.as_millis())))?;
        let mut listed = self.view.listed();
        let snapshot = self.view.snapshot(&listed);
        self.send(snapshot)?;
        let mut health = self.view.health();
        let mut stale = false;
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = closed.cancelled() => return Ok(()),
                () = self.frames.closed() => return Err(Ended::Closed),
                received = live.recv() => match received {
                    Ok(recorded) => {
                        let step = self.view.step(&recorded);
                        self.send(step)?;
                    }
                    // Some steps were missed: the next poll sends a fresh snapshot.
                    Err(broadcast::error::RecvError::Lagged(_)) => stale = true,
                    Err(broadcast::error::RecvError::Closed) => return Ok(()),
                },
                _ = poll.tick() => {
                    let now = self.view.listed();
                    if stale {
                        stale = false;
                        let snapshot = self.view.snapshot(&now);
                        self.send(snapshot)?;
                    } else {
                        let (changed, gone) = changes(&listed, &now);
                        for host in changed {
                            self.send(frame(HOST, host))?;
                        }
                        for mac in gone {
                            self.send(frame(GONE, &Gone { mac }))?;
                        }
                        let current = self.view.health();
                        if current != health {
                            self.send(frame(HEALTH, &current))?;
                            health = current;
                        }
                    }
                    listed = now;
                    if self.last_sent.elapsed() >= KEEPALIVE {
                        self.send(Bytes::from_static(b": keep-alive\n\n"))?;
                    }
                }
            }
        }
    }

    fn send(&mut self, frame: Bytes) -> Result<(), Ended> {
        self.frames.try_send(frame).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => Ended::TooSlow,
            mpsc::error::TrySendError::Closed(_) => Ended::Closed,
        })?;
        self.last_sent = Instant::now();
        Ok(())
    }
}

/// The body of an event stream: the frames its task queues, until the task ends.
struct EventBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for EventBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0.poll_recv(cx).map(|frame| frame.map(|bytes| Ok(Frame::data(bytes))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{ByteProgress, Claim, OperationSummary};

    fn host(mac: &str, state: &str) -> HostSummary {
        HostSummary {
            mac: mac.parse().unwrap(),
            name: Some("default/node-1".into()),
            state: state.into(),
            address: None,
            claim: None,
            operation: None,
        }
    }

    /// The data lines of SSE `text`, parsed as a browser does.
    fn events_of(text: &str) -> Vec<(String, serde_json::Value)> {
        text.split("\n\n")
            .filter(|block| !block.is_empty())
            .map(|block| {
                let mut name = String::new();
                let mut data = Vec::new();
                for line in block.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.to_owned();
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data.push(d);
                    } else {
                        panic!("unexpected line {line:?} in {text:?}");
                    }
                }
                (name, serde_json::from_str(&data.join("\n")).unwrap())
            })
            .collect()
    }

    #[test]
    fn a_hostile_detail_stays_inside_its_event() {
        let detail =
            "x\n\nevent: snapshot\ndata: {\"site\":\"owned\"}\r\n\n<img src=x onerror=alert(1)>";
        let event = Event { at_ms: 5, stage: Stage::HttpFile, detail: detail.into() };
        let step = Step {
            mac: "52:54:00:00:00:01".parse().unwrap(),
            step: StepView::of(&event),
            chart: vec![],
        };
        let text = String::from_utf8(frame(STEP, &step).to_vec()).unwrap();
        let events = events_of(&text);
        assert_eq!(events.len(), 1, "{text}");
        let (name, data) = &events[0];
        assert_eq!(name, "step");
        assert_eq!(data["detail"], detail, "the detail arrives whole, as a string");
        assert_eq!(data["mac"], "52:54:00:00:00:01");
        assert_eq!(data["stage"], "http-file");
    }

    #[test]
    fn host_rows_carry_the_summary_and_the_chart() {
        let mut summary = host("52:54:00:00:00:01", "Provisioning");
        summary.claim = Some(Claim::Claimed);
        summary.operation = Some(OperationSummary {
            kind: "Provision".into(),
            step: Some("writing image".into()),
            bytes: Some(ByteProgress { done: 5, total: 10 }),
        });
        let long = Event { at_ms: 7, stage: Stage::Report, detail: "é".repeat(MAX_DETAIL + 1) };
        let row =
            HostRow { host: summary, listed: true, chart: vec![], last: Some(StepView::of(&long)) };
        let json = serde_json::to_value(&row).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "mac": "52:54:00:00:00:01",
                "name": "default/node-1",
                "state": "Provisioning",
                "address": null,
                "claim": "claimed",
                "operation": {
                    "kind": "Provision", "step": "writing image",
                    "bytes": { "done": 5, "total": 10 },
                },
                "listed": true,
                "chart": [],
                "last": { "stage": "report", "at_ms": 7, "detail": "é".repeat(MAX_DETAIL) },
            })
        );
    }

    #[test]
    fn changes_are_new_or_different_hosts_and_gone_ones() {
        let a = host("52:54:00:00:00:01", "Available");
        let b = host("52:54:00:00:00:02", "Available");
        let before: Listed = [(a.mac, a.clone()), (b.mac, b.clone())].into();
        let mut moved = a.clone();
        moved.state = "Provisioning".into();
        let c = host("52:54:00:00:00:03", "Registering");
        let now: Listed = [(moved.mac, moved.clone()), (c.mac, c.clone())].into();
        let (mut changed, gone) = changes(&before, &now);
        changed.sort_by_key(|h| h.mac.to_string());
        assert_eq!(changed, [&moved, &c]);
        assert_eq!(gone, [b.mac]);
        assert_eq!(changes(&now, &now), (vec![], vec![]));
    }

    #[test]
    fn roles() {
        let now = tokio::time::Instant::now();
        let later = now + Duration::from_secs(10);
        assert_eq!(Role::of(&Leadership::Always, now), Role::OnlyReplica);
        assert_eq!(Role::of(&Leadership::Leader { until: later }, now), Role::Leader);
        assert_eq!(Role::of(&Leadership::Leader { until: now }, later), Role::Standby);
        assert_eq!(Role::of(&Leadership::Follower, now), Role::Standby);
        assert_eq!(serde_json::to_value(Role::OnlyReplica).unwrap(), "only-replica");
    }
}
