//! What a DHCP client says about itself: firmware architecture (option 93), whether it is iPXE
//! (user class / option 175), and whether it is a PXE or UEFI HTTP boot client (option 60).

use dhcproto::v4::{DhcpOption, Message, OptionCode};
use siteboot_ipxe::Platform;

use crate::MacAddr;

/// Client system architecture, RFC 4578 option 93 with the IANA registry's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientArch {
    /// 0: x86 BIOS.
    Bios,
    /// 7 (and 9, which some x86-64 firmware sends): x86-64 UEFI.
    UefiX64,
    /// 11: arm64 UEFI.
    UefiArm64,
    /// 16: x86-64 UEFI HTTP boot.
    UefiHttpX64,
    /// 19: arm64 UEFI HTTP boot.
    UefiHttpArm64,
    /// Anything else (IA32 UEFI, Itanium, ...): not served.
    Other(u16),
}

impl ClientArch {
    pub fn from_code(code: u16) -> Self {
        match code {
            0 => Self::Bios,
            7 | 9 => Self::UefiX64,
            11 => Self::UefiArm64,
            16 => Self::UefiHttpX64,
            19 => Self::UefiHttpArm64,
            other => Self::Other(other),
        }
    }

    /// The iPXE build this firmware runs, if we serve one.
    pub fn platform(self) -> Option<Platform> {
        match self {
            Self::Bios => Some(Platform::Bios),
            Self::UefiX64 | Self::UefiHttpX64 => Some(Platform::UefiX64),
            Self::UefiArm64 | Self::UefiHttpArm64 => Some(Platform::UefiArm64),
            Self::Other(_) => None,
        }
    }

    pub fn is_http_boot(self) -> bool {
        matches!(self, Self::UefiHttpX64 | Self::UefiHttpArm64)
    }
}

/// The vendor class (option 60) prefix a firmware PXE client sends.
pub const PXE_CLIENT: &[u8] = b"PXEClient";
/// The vendor class (option 60) prefix a UEFI HTTP boot client sends.
pub const HTTP_CLIENT: &[u8] = b"HTTPClient";
/// iPXE's encapsulated options (option 175): present only in requests from iPXE.
const IPXE_ENCAPSULATED: u8 = 175;

/// The boot-relevant facts about one DHCP client, read from one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootClient {
    pub mac: MacAddr,
    /// `None` when the client sent no option 93 (an OS DHCP client, or old firmware).
    pub arch: Option<ClientArch>,
    /// Vendor class starts with `PXEClient` or `HTTPClient`: firmware asking to network-boot.
    pub firmware_boot: bool,
    /// Vendor class starts with `HTTPClient`: a UEFI HTTP boot client wanting a URL.
    pub http_client: bool,
    /// User class `iPXE` or option 175: iPXE is already running, so send it the script, not
    /// the iPXE binary again (which would loop).
    pub ipxe: bool,
}

impl BootClient {
    /// `None` for a non-Ethernet `chaddr` (we identify hosts by MAC only).
    pub fn from_message(msg: &Message) -> Option<Self> {
        if msg.hlen() != 6 {
            return None;
        }
        let mac = MacAddr::from_chaddr(msg.chaddr())?;
        let opts = msg.opts();
        let arch = match opts.get(OptionCode::ClientSystemArchitecture) {
            Some(DhcpOption::ClientSystemArchitecture(a)) => Some(ClientArch::from_code(a.0)),
            _ => None,
        };
        let vendor_class = match opts.get(OptionCode::ClassIdentifier) {
            Some(DhcpOption::ClassIdentifier(v)) => v.as_slice(),
            _ => &[],
        };
        let http_client = vendor_class.starts_with(HTTP_CLIENT);
        let firmware_boot = http_client || vendor_class.starts_with(PXE_CLIENT);
        let user_class_ipxe = match opts.get(OptionCode::UserClass) {
            Some(DhcpOption::UserClass(v)) => user_class_contains(v, b"iPXE"),
            _ => false,
        };
        let ipxe = user_class_ipxe || opts.get(OptionCode::from(IPXE_ENCAPSULATED)).is_some();
        Some(Self { mac, arch, firmware_boot, http_client, ipxe })
    }
}

/// Option 77 is, per RFC 3004, a list of length-prefixed class names, but iPXE and many clients
/// send the bare string. Accept both.
fn user_class_contains(data: &[u8], class: &[u8]) -> bool {
    if data == class {
        return true;
    }
    let mut rest = data;
    while let Some((&len, tail)) = rest.split_first() {
        let len = len as usize;
        if len == 0 || len > tail.len() {
            return false;
        }
        if &tail[..len] == class {
            return true;
        }
        rest = &tail[len..];
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::v4::{Architecture, MessageType};

    fn message(opts: Vec<DhcpOption>) -> Message {
        let mut msg = Message::default();
        msg.set_chaddr(&[0x52, 0x54, 0, 1, 2, 3]);
        msg.opts_mut().insert(DhcpOption::MessageType(MessageType::Discover));
        for o in opts {
            msg.opts_mut().insert(o);
        }
        msg
    }

    #[test]
    fn reads_arch_vendor_class_and_ipxe() {
        let msg = message(vec![
            DhcpOption::ClientSystemArchitecture(Architecture(7)),
            DhcpOption::ClassIdentifier(b"PXEClient:Arch:00007:UNDI:003000".to_vec()),
        ]);
        let c = BootClient::from_message(&msg).unwrap();
        assert_eq!(c.mac.to_string(), "52:54:00:01:02:03");
        assert_eq!(c.arch, Some(ClientArch::UefiX64));
        assert!(c.firmware_boot && !c.http_client && !c.ipxe);

        let msg = message(vec![DhcpOption::UserClass(b"iPXE".to_vec())]);
        assert!(BootClient::from_message(&msg).unwrap().ipxe);
        let msg = message(vec![DhcpOption::UserClass(b"\x04iPXE".to_vec())]);
        assert!(BootClient::from_message(&msg).unwrap().ipxe);
        let msg = message(vec![DhcpOption::Unknown(dhcproto::v4::UnknownOption::new(
            OptionCode::from(175),
            vec![1, 1, 1],
        ))]);
        assert!(BootClient::from_message(&msg).unwrap().ipxe);

        let msg = message(vec![
            DhcpOption::ClientSystemArchitecture(Architecture(16)),
            DhcpOption::ClassIdentifier(b"HTTPClient:Arch:00016:UNDI:003001".to_vec()),
        ]);
        let c = BootClient::from_message(&msg).unwrap();
        assert_eq!(c.arch, Some(ClientArch::UefiHttpX64));
        assert!(c.firmware_boot && c.http_client);
    }

    #[test]
    fn user_class_parsing_is_bounded() {
        assert!(!user_class_contains(b"\xffiPXE", b"iPXE"));
        assert!(!user_class_contains(b"\x00", b"iPXE"));
        assert!(user_class_contains(b"\x03abc\x04iPXE", b"iPXE"));
    }
}
