//! A host's boot timeline as the status page draws it: its latest run of steps cut into
//! phases (DHCP, firmware download, iPXE script, kernel, ramdisk, ...), each lasting until the
//! next one starts.

use std::time::Duration;

use serde::Serialize;

use crate::timeline::{Event, Stage};

/// A pause this long between two steps ends a run: the chart shows the steps after the last
/// such pause, a network boot and what follows it (imaging, the reboot into the installed OS).
const RUN_GAP: Duration = Duration::from_secs(10 * 60);
/// Segments kept, the latest: a host stuck in a boot loop still gets a readable chart.
const MAX_SEGMENTS: usize = 32;
/// Characters of a step's detail a segment keeps (the full detail is in `/timeline/<mac>`).
const MAX_DETAIL: usize = 120;

/// What a step was part of, in the order of a network boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// DHCP or proxyDHCP, from the firmware, iPXE or the booted kernel.
    Dhcp,
    /// The iPXE binary over TFTP.
    Firmware,
    /// The iPXE script.
    Script,
    /// The first file the script fetches: the kernel.
    Kernel,
    /// The files fetched right after the kernel: the initrds.
    Ramdisk,
    /// Other files over HTTP: an image the ramdisk writes, or iPXE for UEFI HTTP boot.
    Download,
    /// A script that boots the local disk: the host's boot into its installed OS.
    LocalDisk,
    /// A callback from the host (`POST /report/<mac>/<stage>`).
    Report,
}

impl Phase {
    /// The phase of a step, given the phase of the step before it (kernel and initrds are
    /// told apart by their order after the script).
    fn of(event: &Event, previous: Option<Phase>) -> Phase {
        match event.stage {
            Stage::DhcpDiscover
            | Stage::DhcpOffer
            | Stage::DhcpRequest
            | Stage::DhcpAck
            | Stage::DhcpNak
            | Stage::DhcpDecline
            | Stage::DhcpRelease
            | Stage::ProxyOffer
            | Stage::ProxyAck => Phase::Dhcp,
            Stage::TftpStart | Stage::TftpDone | Stage::TftpFailed => Phase::Firmware,
            // The detail of a script step is its first command (see `describe_script`).
            Stage::IpxeScript => match event.detail.split(' ').next() {
                Some("exit" | "sanboot") => Phase::LocalDisk,
                _ => Phase::Script,
            },
            Stage::HttpFile => match previous {
                Some(Phase::Script) => Phase::Kernel,
                Some(Phase::Kernel | Phase::Ramdisk) => Phase::Ramdisk,
                _ => Phase::Download,
            },
            Stage::Report => Phase::Report,
        }
    }
}

/// Consecutive steps of one phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Segment {
    pub phase: Phase,
    /// When its first step was recorded, in milliseconds since the Unix epoch.
    pub start_ms: u64,
    /// When the next segment started; for the last one, when its last step was recorded.
    pub end_ms: u64,
    pub steps: u32,
    /// The last step's detail, shortened.
    pub detail: String,
}

/// The chart of `events` (oldest first, as the timeline keeps them).
pub fn chart(events: &[Event]) -> Vec<Segment> {
    let gap = RUN_GAP.as_millis() as u64;
    let start = events
        .windows(2)
        .rposition(|pair| pair[1].at_ms.saturating_sub(pair[0].at_ms) >= gap)
        .map_or(0, |i| i + 1);
    let mut segments: Vec<Segment> = Vec::new();
    let mut previous = None;
    for event in &events[start..] {
        let phase = Phase::of(event, previous);
        let detail: String = event.detail.chars().take(MAX_DETAIL).collect();
        match segments.last_mut() {
            // Each report is a milestone of its own.
            Some(last) if last.phase == phase && phase != Phase::Report => {
                last.end_ms = event.at_ms;
                last.steps += 1;
                last.detail = detail;
            }
            last => {
                if let Some(last) = last {
                    last.end_ms = event.at_ms;
                }
                segments.push(Segment {
                    phase,
                    start_ms: event.at_ms,
                    end_ms: event.at_ms,
                    steps: 1,
                    detail,
                });
            }
        }
        previous = Some(phase);
    }
    let excess = segments.len().saturating_sub(MAX_SEGMENTS);
    segments.drain(..excess);
    segments
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(at_ms: u64, stage: Stage, detail: &str) -> Event {
        Event { at_ms, stage, detail: detail.to_owned() }
    }

    fn phases(segments: &[Segment]) -> Vec<(Phase, u64, u64, u32)> {
        segments.iter().map(|s| (s.phase, s.start_ms, s.end_ms, s.steps)).collect()
    }

    #[test]
    fn a_uefi_network_boot_in_phases_each_until_the_next() {
        let events = [
            event(1_000, Stage::DhcpDiscover, "arch=Some(Uefi) ipxe=false"),
            event(1_010, Stage::DhcpOffer, ""),
            event(1_020, Stage::DhcpRequest, ""),
            event(1_030, Stage::DhcpAck, ""),
            event(1_500, Stage::TftpStart, "snponly.efi"),
            event(2_500, Stage::TftpDone, "snponly.efi"),
            event(3_000, Stage::DhcpDiscover, "ipxe=true"),
            event(3_100, Stage::DhcpAck, ""),
            event(3_200, Stage::IpxeScript, "kernel http://10.99.0.1:8080/files/vmlinuz"),
            event(3_300, Stage::HttpFile, "vmlinuz 200 (1000 bytes)"),
            event(5_300, Stage::HttpFile, "initrd.img 200 (9000 bytes)"),
            event(9_000, Stage::DhcpDiscover, ""),
            event(9_100, Stage::DhcpAck, ""),
            event(9_500, Stage::HttpFile, "images/debian.raw 200 (9 bytes)"),
            event(20_000, Stage::Report, "image-written from 10.99.0.100"),
            event(20_100, Stage::Report, "rebooting from 10.99.0.100"),
            event(40_000, Stage::DhcpDiscover, ""),
            event(40_100, Stage::IpxeScript, "exit"),
        ];
        assert_eq!(
            phases(&chart(&events)),
            [
                (Phase::Dhcp, 1_000, 1_500, 4),
                (Phase::Firmware, 1_500, 3_000, 2),
                (Phase::Dhcp, 3_000, 3_200, 2),
                (Phase::Script, 3_200, 3_300, 1),
                (Phase::Kernel, 3_300, 5_300, 1),
                (Phase::Ramdisk, 5_300, 9_000, 1),
                (Phase::Dhcp, 9_000, 9_500, 2),
                (Phase::Download, 9_500, 20_000, 1),
                (Phase::Report, 20_000, 20_100, 1),
                (Phase::Report, 20_100, 40_000, 1),
                (Phase::Dhcp, 40_000, 40_100, 1),
                (Phase::LocalDisk, 40_100, 40_100, 1),
            ]
        );
    }

    #[test]
    fn the_chart_is_the_run_after_the_last_long_pause() {
        let gap = RUN_GAP.as_millis() as u64;
        let events = [
            event(0, Stage::DhcpDiscover, ""),
            event(100, Stage::IpxeScript, "kernel x"),
            event(100 + gap, Stage::DhcpDiscover, ""),
            event(200 + gap, Stage::IpxeScript, "sanboot --drive 0x80"),
        ];
        assert_eq!(
            phases(&chart(&events)),
            [(Phase::Dhcp, 100 + gap, 200 + gap, 1), (Phase::LocalDisk, 200 + gap, 200 + gap, 1)]
        );
        assert!(chart(&[]).is_empty());
    }

    #[test]
    fn a_boot_loop_keeps_the_latest_segments_and_details_are_short() {
        let long = "x".repeat(1000);
        let events: Vec<Event> = (0..100)
            .map(|i| {
                let stage = if i % 2 == 0 { Stage::DhcpDiscover } else { Stage::TftpFailed };
                event(i * 1000, stage, &long)
            })
            .collect();
        let segments = chart(&events);
        assert_eq!(segments.len(), MAX_SEGMENTS);
        assert_eq!(segments.last().unwrap().start_ms, 99_000);
        assert!(segments.iter().all(|s| s.detail.chars().count() == MAX_DETAIL));
    }
}
