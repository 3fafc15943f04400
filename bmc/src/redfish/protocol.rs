//! The Redfish protocol without I/O: the bodies siteboot sends and what it reads from the
//! answers (DMTF Redfish, ComputerSystem / EthernetInterface / SessionService schemas).

use http::StatusCode;
use serde_json::{Value, json};

use crate::{BootMode, Credentials, PowerState};

/// `ComputerSystem.Reset`'s `ResetType`s siteboot uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetType {
    On,
    ForceOff,
    ForceRestart,
    GracefulShutdown,
}

impl ResetType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::On => "On",
            Self::ForceOff => "ForceOff",
            Self::ForceRestart => "ForceRestart",
            Self::GracefulShutdown => "GracefulShutdown",
        }
    }
}

/// The `ComputerSystem.Reset` action's path for `system`.
pub fn reset_path(system: &str) -> String {
    format!("{system}/Actions/ComputerSystem.Reset")
}

pub fn reset_body(reset: ResetType) -> Value {
    json!({ "ResetType": reset.as_str() })
}

/// A device a system can boot once from (`BootSourceOverrideTarget`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootTarget {
    Pxe,
    /// The virtual CD: inserted virtual media.
    Cd,
    /// The local disk.
    Hdd,
}

/// The PATCH of the system that makes its next boot, and only that one, from `target` (in
/// `mode`'s firmware path, the `BootSourceOverrideMode`, when given).
pub fn boot_once_body(target: BootTarget, mode: Option<BootMode>) -> Value {
    let target = match target {
        BootTarget::Pxe => "Pxe",
        BootTarget::Cd => "Cd",
        BootTarget::Hdd => "Hdd",
    };
    let mut boot = json!({
        "BootSourceOverrideTarget": target,
        "BootSourceOverrideEnabled": "Once",
    });
    if let Some(mode) = mode {
        boot["BootSourceOverrideMode"] = json!(match mode {
            BootMode::Uefi => "UEFI",
            BootMode::Legacy => "Legacy",
        });
    }
    json!({ "Boot": boot })
}

pub fn session_body(credentials: &Credentials) -> Value {
    json!({ "UserName": credentials.username(), "Password": credentials.password() })
}

/// The sessions collection the service root links to; `None`: the BMC has no session
/// service, and every request carries basic authentication.
pub fn sessions_path(service_root: &Value) -> Option<String> {
    odata_id(&service_root["Links"]["Sessions"])
}

/// The path of a new session's `Location` (which may be an absolute URI): what to DELETE.
pub fn location_path(location: &str) -> String {
    match location.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]).to_owned(),
        None => location.to_owned(),
    }
}

/// The system's power, from its `PowerState` (transitions count as where they are going).
pub fn power_state(system: &Value) -> Result<PowerState, ProtocolError> {
    match system["PowerState"].as_str() {
        Some("On" | "PoweringOn") => Ok(PowerState::On),
        Some("Off" | "PoweringOff") => Ok(PowerState::Off),
        Some("Paused") => Ok(PowerState::On),
        Some(other) => Err(ProtocolError(format!("unknown PowerState {other:?}"))),
        None => Err(ProtocolError("the system has no PowerState".into())),
    }
}

/// The system's UUID, lower case (what the host's SMBIOS says, and so what DHCP sees).
pub fn system_uuid(system: &Value) -> Result<String, ProtocolError> {
    let uuid = system["UUID"].as_str().ok_or(ProtocolError("the system has no UUID".into()))?;
    let canonical = uuid.len() == 36
        && uuid.bytes().enumerate().all(|(i, b)| {
            if [8, 13, 18, 23].contains(&i) { b == b'-' } else { b.is_ascii_hexdigit() }
        });
    if !canonical {
        return Err(ProtocolError(format!("the system's UUID {uuid:?} is not a UUID")));
    }
    Ok(uuid.to_ascii_lowercase())
}

/// The system's EthernetInterfaces collection, if it has one.
pub fn ethernet_interfaces_path(system: &Value) -> Option<String> {
    odata_id(&system["EthernetInterfaces"])
}

/// The paths of a collection's members.
pub fn members(collection: &Value) -> Result<Vec<String>, ProtocolError> {
    let members = collection["Members"]
        .as_array()
        .ok_or(ProtocolError("the collection has no Members".into()))?;
    members
        .iter()
        .map(|m| odata_id(m).ok_or(ProtocolError("a collection member has no @odata.id".into())))
        .collect()
}

/// An EthernetInterface's MAC address, lower case and colon-separated like `spec.bootMACAddress`.
pub fn mac_address(nic: &Value) -> Result<String, ProtocolError> {
    let raw = nic["PermanentMACAddress"]
        .as_str()
        .filter(|s| !s.is_empty())
        .or(nic["MACAddress"].as_str())
        .ok_or(ProtocolError("the EthernetInterface has no MACAddress".into()))?;
    let hex: String = raw.chars().filter(|c| !matches!(c, ':' | '-' | '.')).collect();
    if hex.len() != 12 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ProtocolError(format!("{raw:?} is not a MAC address")));
    }
    let hex = hex.to_ascii_lowercase();
    let pairs: Vec<&str> = (0..6).map(|i| &hex[2 * i..2 * i + 2]).collect();
    Ok(pairs.join(":"))
}

/// What the system reports about its boot override (`BootSourceOverrideTarget`, `...Enabled`,
/// `...Mode`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootOverride {
    pub target: Option<String>,
    pub enabled: Option<String>,
    pub mode: Option<String>,
}

pub fn boot_override(system: &Value) -> BootOverride {
    let field = |name: &str| system["Boot"][name].as_str().map(str::to_owned);
    BootOverride {
        target: field("BootSourceOverrideTarget"),
        enabled: field("BootSourceOverrideEnabled"),
        mode: field("BootSourceOverrideMode"),
    }
}

/// Where the system's virtual media are: its own `VirtualMedia` collection (Redfish 2021.2
/// and later), else the one of the manager that manages it (`Links.ManagedBy`), which takes
/// one more read ([`MediaCollection::Manager`]).
pub fn virtual_media_path(system: &Value) -> Option<MediaCollection> {
    if let Some(path) = odata_id(&system["VirtualMedia"]) {
        return Some(MediaCollection::Here(path));
    }
    let manager = system["Links"]["ManagedBy"].as_array()?.first().and_then(odata_id)?;
    Some(MediaCollection::Manager(manager))
}

/// Where a system's virtual media collection is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MediaCollection {
    Here(String),
    /// In this manager's `VirtualMedia`.
    Manager(String),
}

/// A manager's virtual media collection.
pub fn manager_virtual_media_path(manager: &Value) -> Option<String> {
    odata_id(&manager["VirtualMedia"])
}

/// A virtual media device, as far as booting from it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualMedia {
    /// Whether it takes a CD or DVD image (an ISO).
    pub takes_cd: bool,
    pub inserted: bool,
    /// The `VirtualMedia.InsertMedia` and `VirtualMedia.EjectMedia` action targets.
    pub insert: String,
    pub eject: String,
    /// The certificates it trusts for HTTPS image servers, where the BMC can check them
    /// (`Certificates`, with `VerifyCertificate`: VirtualMedia 1.4 and later).
    pub certificates: Option<String>,
    /// Whether it checks the image server's certificate now.
    pub verifies: bool,
}

/// Reads the virtual media device at `path`.
pub fn virtual_media(path: &str, media: &Value) -> VirtualMedia {
    let types = media["MediaTypes"].as_array();
    let takes_cd = types.into_iter().flatten().any(|t| matches!(t.as_str(), Some("CD" | "DVD")));
    let action = |name: &str| {
        media["Actions"][format!("#VirtualMedia.{name}")]["target"]
            .as_str()
            .filter(|t| t.starts_with('/'))
            .map_or_else(|| format!("{path}/Actions/VirtualMedia.{name}"), str::to_owned)
    };
    let verify = &media["VerifyCertificate"];
    VirtualMedia {
        takes_cd,
        inserted: media["Inserted"].as_bool().unwrap_or(false),
        insert: action("InsertMedia"),
        eject: action("EjectMedia"),
        certificates: odata_id(&media["Certificates"]).filter(|_| verify.is_boolean()),
        verifies: verify.as_bool() == Some(true),
    }
}

/// The POST to a `Certificates` collection that adds `pem`.
pub fn certificate_body(pem: &str) -> Value {
    json!({ "CertificateString": pem, "CertificateType": "PEM" })
}

/// Whether the certificate resource `certificate` holds `pem` (line ends aside).
pub fn holds_certificate(certificate: &Value, pem: &str) -> bool {
    let normal = |s: &str| s.replace("\r\n", "\n").trim().to_owned();
    certificate["CertificateString"].as_str().is_some_and(|s| normal(s) == normal(pem))
}

/// The PATCH of a virtual media device that makes it check the image server's certificate.
pub fn verify_certificate_body() -> Value {
    json!({ "VerifyCertificate": true })
}

/// The `VirtualMedia.InsertMedia` body: the image at `url`, read-only, inserted now.
pub fn insert_media_body(url: &str) -> Value {
    let mut body = json!({ "Image": url, "Inserted": true, "WriteProtected": true });
    if url.starts_with("https://") {
        body["TransferProtocolType"] = json!("HTTPS");
    }
    body
}

/// What went wrong, from an error answer: the status, and the Redfish error's own message (the
/// first extended message, else `error.message`). Never the body itself: whatever answers may
/// be a server a Host editor named, and the message ends up in the Host's status.
pub fn error_message(status: StatusCode, body: &[u8]) -> String {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let message = parsed.as_ref().and_then(|v| {
        let error = &v["error"];
        error["@Message.ExtendedInfo"][0]["Message"].as_str().or(error["message"].as_str())
    });
    match message.map(str::trim) {
        None | Some("") => status.to_string(),
        Some(message) => format!("{status}: {message}"),
    }
}

/// An answer siteboot cannot make sense of.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ProtocolError(pub String);

fn odata_id(link: &Value) -> Option<String> {
    link["@odata.id"].as_str().filter(|s| s.starts_with('/')).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_say_what_redfish_expects() {
        assert_eq!(reset_body(ResetType::ForceRestart), json!({"ResetType": "ForceRestart"}));
        assert_eq!(reset_body(ResetType::GracefulShutdown)["ResetType"], "GracefulShutdown");
        assert_eq!(
            reset_path("/redfish/v1/Systems/1"),
            "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset"
        );
        assert_eq!(
            boot_once_body(BootTarget::Pxe, None),
            json!({"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}})
        );
        assert_eq!(
            boot_once_body(BootTarget::Pxe, Some(BootMode::Uefi))["Boot"]["BootSourceOverrideMode"],
            "UEFI"
        );
        assert_eq!(
            boot_once_body(BootTarget::Cd, Some(BootMode::Legacy))["Boot"],
            json!({"BootSourceOverrideTarget": "Cd", "BootSourceOverrideEnabled": "Once",
                "BootSourceOverrideMode": "Legacy"})
        );
        assert_eq!(
            insert_media_body("https://10.0.0.1:8443/media/k.iso"),
            json!({"Image": "https://10.0.0.1:8443/media/k.iso", "Inserted": true,
                "WriteProtected": true, "TransferProtocolType": "HTTPS"})
        );
        let c = Credentials::new("admin", "pw").unwrap();
        assert_eq!(session_body(&c), json!({"UserName": "admin", "Password": "pw"}));
    }

    #[test]
    fn a_service_root_without_sessions_means_basic_authentication() {
        let root =
            json!({"Links": {"Sessions": {"@odata.id": "/redfish/v1/SessionService/Sessions"}}});
        assert_eq!(sessions_path(&root).as_deref(), Some("/redfish/v1/SessionService/Sessions"));
        assert_eq!(sessions_path(&json!({"Systems": {"@odata.id": "/redfish/v1/Systems"}})), None);
        let session = "/redfish/v1/SessionService/Sessions/7";
        assert_eq!(location_path(session), session);
        assert_eq!(location_path(&format!("https://10.0.0.5:443{session}")), session);
    }

    #[test]
    fn reads_power_uuid_and_boot_override_from_a_system() {
        let system = json!({
            "UUID": "0B5A1C2D-0000-4000-8000-0123456789AB",
            "PowerState": "On",
            "Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Continuous",
                     "BootSourceOverrideMode": "UEFI"},
            "EthernetInterfaces": {"@odata.id": "/redfish/v1/Systems/1/EthernetInterfaces"},
        });
        assert_eq!(power_state(&system), Ok(PowerState::On));
        assert_eq!(power_state(&json!({"PowerState": "PoweringOff"})), Ok(PowerState::Off));
        assert!(power_state(&json!({"PowerState": "Sideways"})).is_err());
        assert!(power_state(&json!({})).is_err());
        assert_eq!(system_uuid(&system).unwrap(), "0b5a1c2d-0000-4000-8000-0123456789ab");
        assert!(system_uuid(&json!({"UUID": "not-a-uuid"})).is_err());
        assert_eq!(
            boot_override(&system),
            BootOverride {
                target: Some("Pxe".into()),
                enabled: Some("Continuous".into()),
                mode: Some("UEFI".into())
            }
        );
        assert_eq!(
            ethernet_interfaces_path(&system).as_deref(),
            Some("/redfish/v1/Systems/1/EthernetInterfaces")
        );
    }

    #[test]
    fn reads_members_and_macs() {
        let collection = json!({"Members": [{"@odata.id": "/a/1"}, {"@odata.id": "/a/2"}]});
        assert_eq!(members(&collection).unwrap(), ["/a/1", "/a/2"]);
        assert!(members(&json!({"Members": [{}]})).is_err());
        assert_eq!(
            mac_address(&json!({"MACAddress": "52:54:00:AB:CD:EF"})).unwrap(),
            "52:54:00:ab:cd:ef"
        );
        assert_eq!(
            mac_address(&json!({"PermanentMACAddress": "52-54-00-00-00-01", "MACAddress": "02:00:00:00:00:09"}))
                .unwrap(),
            "52:54:00:00:00:01"
        );
        assert!(mac_address(&json!({"MACAddress": "52:54:00"})).is_err());
    }

    #[test]
    fn error_messages_come_from_the_redfish_error_body() {
        let body = br#"{"error": {"code": "Base.1.0.GeneralError", "message": "general",
            "@Message.ExtendedInfo": [{"Message": "The property Foo is unknown."}]}}"#;
        assert_eq!(
            error_message(StatusCode::BAD_REQUEST, body),
            "400 Bad Request: The property Foo is unknown."
        );
        assert_eq!(error_message(StatusCode::NOT_FOUND, b""), "404 Not Found");
        assert_eq!(error_message(StatusCode::BAD_GATEWAY, b"upstream down"), "502 Bad Gateway");
    }

    #[test]
    fn finds_the_virtual_cd_on_the_system_or_its_manager() {
        let system = json!({"VirtualMedia": {"@odata.id": "/redfish/v1/Systems/1/VirtualMedia"},
            "Links": {"ManagedBy": [{"@odata.id": "/redfish/v1/Managers/1"}]}});
        assert_eq!(
            virtual_media_path(&system),
            Some(MediaCollection::Here("/redfish/v1/Systems/1/VirtualMedia".into()))
        );
        let older = json!({"Links": {"ManagedBy": [{"@odata.id": "/redfish/v1/Managers/1"}]}});
        assert_eq!(
            virtual_media_path(&older),
            Some(MediaCollection::Manager("/redfish/v1/Managers/1".into()))
        );
        assert_eq!(virtual_media_path(&json!({})), None);
        let manager = json!({"VirtualMedia": {"@odata.id": "/redfish/v1/Managers/1/VirtualMedia"}});
        assert_eq!(
            manager_virtual_media_path(&manager).as_deref(),
            Some("/redfish/v1/Managers/1/VirtualMedia")
        );

        let path = "/redfish/v1/Systems/1/VirtualMedia/Cd";
        let cd = json!({"MediaTypes": ["CD", "DVD"], "Inserted": true, "Actions": {
            "#VirtualMedia.InsertMedia": {"target": "/x/Insert"}}});
        assert_eq!(
            virtual_media(path, &cd),
            VirtualMedia {
                takes_cd: true,
                inserted: true,
                insert: "/x/Insert".into(),
                eject: format!("{path}/Actions/VirtualMedia.EjectMedia"),
                certificates: None,
                verifies: false,
            }
        );
        let checking = json!({"MediaTypes": ["CD"], "VerifyCertificate": false,
            "Certificates": {"@odata.id": "/vm/Cd/Certificates"}});
        let checking = virtual_media(path, &checking);
        assert_eq!(
            (checking.certificates.as_deref(), checking.verifies),
            (Some("/vm/Cd/Certificates"), false)
        );
        let pem = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(holds_certificate(&json!({"CertificateString": pem.replace('\n', "\r\n")}), pem));
        assert!(!holds_certificate(&json!({"CertificateString": "other"}), pem));
        assert_eq!(certificate_body(pem)["CertificateType"], "PEM");
        let floppy = virtual_media(path, &json!({"MediaTypes": ["Floppy", "USBStick"]}));
        assert!(!floppy.takes_cd && !floppy.inserted);
    }
}
