//! A host's timeline: what a test (or the demo) saw happen, and the appliance's own record of
//! the host's boots (`GET /timeline/<mac>`: DHCP, scripts, files, the ramdisk's reports),
//! rendered together in order, in seconds since it started.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::appliance::Appliance;

pub struct Timeline {
    started: SystemTime,
    marks: Mutex<Vec<(SystemTime, String)>>,
    /// The appliance's events, kept before each crash (its record lives in its memory).
    kept: Mutex<Vec<Value>>,
}

impl Timeline {
    pub fn start() -> Self {
        Self { started: SystemTime::now(), marks: Mutex::default(), kept: Mutex::default() }
    }

    /// Records that `what` happened now.
    pub fn mark(&self, what: &str) {
        self.marks.lock().expect("not poisoned").push((SystemTime::now(), what.to_owned()));
    }

    /// Keeps the appliance's record of `mac`'s boots so far (before it is killed).
    pub fn keep_appliance(&self, appliance: &Appliance, mac: &str) {
        if let Ok(record) = appliance.timeline(mac) {
            let events = record["events"].as_array().cloned().unwrap_or_default();
            self.kept.lock().expect("not poisoned").extend(events);
        }
    }

    /// The marks and the appliance's events (those kept and `appliance`, its record now),
    /// one line each, titled `name`, ending with the total.
    pub fn render(&self, name: &str, appliance: &Value) -> String {
        let ms = |at: SystemTime| at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let start = ms(self.started);
        let marks = self.marks.lock().expect("not poisoned");
        let mut lines: Vec<(u64, String)> =
            marks.iter().map(|(at, what)| (ms(*at), format!("test       {what}"))).collect();
        // The boot stages, each run of one stage with one detail once (the ramdisk reports its
        // progress many times).
        let mut last = None;
        let kept = self.kept.lock().expect("not poisoned").clone();
        let now = appliance["events"].as_array().cloned().unwrap_or_default();
        for event in kept.iter().chain(&now) {
            let stage = event["stage"].as_str().unwrap_or_default();
            if stage.starts_with("dhcp-") && stage != "dhcp-ack" {
                continue;
            }
            let detail = event["detail"].as_str().unwrap_or_default();
            let key = (stage.to_owned(), detail.split_whitespace().next().map(str::to_owned));
            if last.as_ref() == Some(&key) {
                continue;
            }
            last = Some(key);
            let at = event["at_ms"].as_u64().unwrap_or_default();
            lines.push((at, format!("appliance  {stage} {detail}")));
        }
        lines.sort_by_key(|(at, _)| *at);
        let mut out = format!("timeline of {name} (seconds since its Host was created):\n");
        for (at, line) in &lines {
            out += &format!("{:>6}  {line}\n", at.saturating_sub(start) / 1000);
        }
        let total = lines.last().map_or(0, |(at, _)| at.saturating_sub(start) / 1000);
        out += &format!("{name}: {total} s in all");
        out
    }
}
