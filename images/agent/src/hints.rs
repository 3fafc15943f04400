//! Choosing the root disk: the disk must match every root device hint the task gives; among
//! those, the smallest that holds the image. A disk a hint rules out is never chosen, however
//! well it would fit otherwise: no hint is "best effort".

use siteboot_agent_api::{Disk, RootDeviceHints};

/// Why no disk was chosen: every disk and what ruled it out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no disk fits: {}", if .0.is_empty() { "this machine has no disks".to_owned() } else {
    .0.iter().map(|(d, why)| format!("{d} {why}")).collect::<Vec<_>>().join("; ")
})]
pub struct NoDisk(pub Vec<(String, Refusal)>);

/// What rules a disk out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("is not the hinted {0}")]
    Hint(&'static str),
    #[error("holds {size} bytes, less than the {needed} needed")]
    TooSmall { size: u64, needed: u64 },
}

/// The first of `hints` that `disk` does not match.
fn mismatch(hints: &RootDeviceHints, disk: &Disk) -> Option<&'static str> {
    let name = hints
        .name
        .as_deref()
        .map(|n| if n.starts_with("/dev/") { n.to_owned() } else { format!("/dev/{n}") });
    let same = |hint: &Option<String>, actual: &Option<String>, norm: fn(&str) -> String| {
        hint.as_ref().is_none_or(|h| actual.as_deref().is_some_and(|a| norm(a) == norm(h)))
    };
    if name.is_some_and(|n| n != disk.name) {
        Some("name")
    } else if !same(&hints.serial, &disk.serial, |s| s.trim().to_owned()) {
        Some("serial")
    } else if !same(&hints.wwn, &disk.wwn, wwn) {
        Some("wwn")
    } else if !same(&hints.model, &disk.model, |s| s.trim().to_lowercase()) {
        Some("model")
    } else if hints.min_size_bytes.unwrap_or(0) > disk.size_bytes {
        Some("minSizeBytes")
    } else if hints.max_size_bytes.is_some_and(|max| max != 0 && max < disk.size_bytes) {
        Some("maxSizeBytes")
    } else {
        None
    }
}

/// The smallest disk that matches every one of `hints` and holds `needed` bytes.
pub fn choose<'a>(
    hints: &RootDeviceHints,
    disks: &'a [Disk],
    needed: u64,
) -> Result<&'a Disk, NoDisk> {
    let mut refused = Vec::new();
    let mut fitting = Vec::new();
    for disk in disks {
        match mismatch(hints, disk) {
            Some(hint) => refused.push((disk.name.clone(), Refusal::Hint(hint))),
            None if disk.size_bytes < needed => refused
                .push((disk.name.clone(), Refusal::TooSmall { size: disk.size_bytes, needed })),
            None => fitting.push(disk),
        }
    }
    // Ties go to the first by name (inspection sorts them), so the choice is repeatable.
    fitting.into_iter().min_by_key(|d| d.size_bytes).ok_or(NoDisk(refused))
}

/// A WWN without its notation: `0x…`, `naa.…`, `eui.…`, `wwn-0x…`, any case.
fn wwn(s: &str) -> String {
    let s = s.trim().to_lowercase();
    let bare = ["wwn-0x", "0x", "naa.", "eui.", "t10."].iter().find_map(|p| s.strip_prefix(p));
    bare.unwrap_or(&s).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn disk(name: &str, gib: u64, serial: &str, wwn: &str, model: &str) -> Disk {
        let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        Disk {
            name: format!("/dev/{name}"),
            size_bytes: gib * GIB,
            model: some(model),
            serial: some(serial),
            wwn: some(wwn),
            rotational: false,
        }
    }

    /// Every hint, alone and combined, against a machine of four disks and two image sizes.
    #[test]
    fn choice_matrix() {
        let disks = [
            disk("sda", 100, "S-A", "naa.5000000000000a", "QEMU HARDDISK   "),
            disk("sdb", 20, "S-B", "naa.5000000000000b", "QEMU HARDDISK"),
            disk("nvme0n1", 500, "S-N", "eui.00253800000000ff", "Fast NVMe"),
            disk("vda", 10, "", "", ""),
        ];
        let hints = |f: fn(&mut RootDeviceHints)| {
            let mut h = RootDeviceHints::default();
            f(&mut h);
            h
        };
        // (hints, image size in GiB, expected disk or the refusals of each disk)
        type Case = (RootDeviceHints, u64, Result<&'static str, Vec<&'static str>>);
        let cases: Vec<Case> = vec![
            (hints(|_| {}), 1, Ok("/dev/vda")),
            (hints(|_| {}), 15, Ok("/dev/sdb")),
            (hints(|_| {}), 600, Err(vec!["too small"; 4])),
            (hints(|h| h.name = Some("sda".into())), 1, Ok("/dev/sda")),
            (hints(|h| h.name = Some("/dev/sda".into())), 1, Ok("/dev/sda")),
            // The hinted disk is too small: no other disk is taken instead.
            (
                hints(|h| h.name = Some("/dev/vda".into())),
                15,
                Err(vec!["name", "name", "name", "too small"]),
            ),
            (hints(|h| h.serial = Some("S-N".into())), 1, Ok("/dev/nvme0n1")),
            (hints(|h| h.serial = Some("S-X".into())), 1, Err(vec!["serial"; 4])),
            (hints(|h| h.wwn = Some("0x5000000000000A".into())), 1, Ok("/dev/sda")),
            (hints(|h| h.wwn = Some("00253800000000ff".into())), 1, Ok("/dev/nvme0n1")),
            (hints(|h| h.model = Some("qemu harddisk".into())), 1, Ok("/dev/sdb")),
            (hints(|h| h.model = Some("qemu harddisk".into())), 50, Ok("/dev/sda")),
            (hints(|h| h.min_size_bytes = Some(50 * GIB)), 1, Ok("/dev/sda")),
            (hints(|h| h.max_size_bytes = Some(50 * GIB)), 1, Ok("/dev/vda")),
            // A size hint of 0 is no hint.
            (hints(|h| h.max_size_bytes = Some(0)), 15, Ok("/dev/sdb")),
            (hints(|h| h.min_size_bytes = Some(0)), 1, Ok("/dev/vda")),
            (
                hints(|h| h.max_size_bytes = Some(50 * GIB)),
                30,
                Err(vec!["maxSizeBytes", "too small", "maxSizeBytes", "too small"]),
            ),
            (
                hints(|h| {
                    h.model = Some("QEMU HARDDISK".into());
                    h.serial = Some("S-A".into());
                    h.max_size_bytes = Some(50 * GIB);
                }),
                1,
                Err(vec!["maxSizeBytes", "serial", "serial", "serial"]),
            ),
        ];
        for (hints, image_gib, expected) in cases {
            let got = choose(&hints, &disks, image_gib * GIB);
            match (&got, &expected) {
                (Ok(disk), Ok(name)) => assert_eq!(&disk.name, name, "{hints:?} {image_gib}"),
                (Err(NoDisk(refusals)), Err(why)) => {
                    let got: Vec<_> = refusals
                        .iter()
                        .map(|(_, r)| match r {
                            Refusal::Hint(h) => *h,
                            Refusal::TooSmall { .. } => "too small",
                        })
                        .collect();
                    assert_eq!(&got, why, "{hints:?} {image_gib}");
                }
                _ => panic!("{hints:?} {image_gib}: got {got:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn no_disk_says_why() {
        let e = choose(&RootDeviceHints::default(), &[], 1).unwrap_err();
        assert_eq!(e.to_string(), "no disk fits: this machine has no disks");
        let disks = [disk("vda", 1, "", "", "")];
        let e = choose(&RootDeviceHints::default(), &disks, 2 * GIB).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no disk fits: /dev/vda holds 1073741824 bytes, less than the 2147483648 needed"
        );
    }
}
