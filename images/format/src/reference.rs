use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use http::Uri;

use crate::{Digest, DigestError};

/// The longest URL accepted: longer ones are hostile or broken, and the cache keeps each
/// image's source URL on disk.
pub const MAX_URL_LEN: usize = 4096;

/// Where an image is fetched from.
#[derive(Clone, PartialEq, Eq)]
pub enum ImageUrl {
    /// `http://` or `https://`, with a host and no credentials.
    Http(Uri),
    /// `file:///absolute/path`, with no `.` or `..` components.
    File(PathBuf),
}

/// An image: where it is fetched from and the SHA-256 it must have. The digest names it; the
/// URL is only where to find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    pub url: ImageUrl,
    pub sha256: Digest,
}

/// Why a text is not an image URL or reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RefError {
    #[error("the URL is {0} bytes long, more than {MAX_URL_LEN}")]
    TooLong(usize),
    #[error("{0:?} is not a URL")]
    Malformed(String),
    #[error("URL scheme {0:?} is not supported (http, https, file)")]
    Scheme(String),
    #[error("the URL has no host")]
    NoHost,
    #[error("the URL carries credentials (user@host); they would be stored and shown with it")]
    Credentials,
    #[error("a file:// URL needs an absolute path (file:///path), not {0:?}")]
    FileNotAbsolute(String),
    #[error("file:// path {0:?} has '.' or '..' components, percent-escapes or NUL")]
    FilePath(String),
    #[error("bad sha256: {0}")]
    Digest(DigestError),
}

impl FromStr for ImageUrl {
    type Err = RefError;
    fn from_str(s: &str) -> Result<Self, RefError> {
        if s.len() > MAX_URL_LEN {
            return Err(RefError::TooLong(s.len()));
        }
        let (scheme, rest) = s.split_once("://").ok_or_else(|| RefError::Malformed(s.into()))?;
        match scheme.to_ascii_lowercase().as_str() {
            "file" => file_path(rest).map(Self::File),
            "http" | "https" => {
                let uri: Uri = s.parse().map_err(|_| RefError::Malformed(s.into()))?;
                let authority = uri.authority().ok_or(RefError::NoHost)?;
                if authority.as_str().contains('@') {
                    return Err(RefError::Credentials);
                }
                if authority.host().is_empty() {
                    return Err(RefError::NoHost);
                }
                Ok(Self::Http(uri))
            }
            _ => Err(RefError::Scheme(scheme.into())),
        }
    }
}

/// The path of `file://<rest>`. Percent-escapes are refused rather than decoded: a cached
/// image's local path is written by its operator, and one spelling keeps it unambiguous.
fn file_path(rest: &str) -> Result<PathBuf, RefError> {
    // file://localhost/path is the same as file:///path (RFC 8089); other hosts are not local.
    let path = rest.strip_prefix("localhost").unwrap_or(rest);
    if !path.starts_with('/') {
        return Err(RefError::FileNotAbsolute(rest.into()));
    }
    let clean = Path::new(path).components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        // `components()` silently drops a `.` in the middle; refuse it too, as spelled.
        && !path.split('/').any(|part| part == ".")
        && !path.contains(['%', '\0', '?', '#']);
    if !clean {
        return Err(RefError::FilePath(path.into()));
    }
    Ok(PathBuf::from(path))
}

impl fmt::Display for ImageUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Http(uri) => write!(f, "{uri}"),
            Self::File(path) => write!(f, "file://{}", path.display()),
        }
    }
}

impl fmt::Debug for ImageUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl ImageRef {
    /// An image from its URL and its digest written `sha256:<hex>`.
    pub fn parse(url: &str, sha256: &str) -> Result<Self, RefError> {
        Ok(Self { url: url.parse()?, sha256: sha256.parse().map_err(RefError::Digest)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn good_references() {
        let r = ImageRef::parse(
            "https://images.example:8443/os/debian.raw?v=2",
            &format!("sha256:{HEX}"),
        )
        .unwrap();
        assert_eq!(r.url.to_string(), "https://images.example:8443/os/debian.raw?v=2");
        assert_eq!(r.sha256.hex(), HEX);
        let ImageUrl::Http(uri) = &r.url else { panic!("{r:?}") };
        assert_eq!(uri.scheme_str(), Some("https"));

        assert_eq!(
            "http://10.0.0.1/a".parse::<ImageUrl>().unwrap().to_string(),
            "http://10.0.0.1/a"
        );
        assert_eq!("file:///srv/img.raw".parse(), Ok(ImageUrl::File("/srv/img.raw".into())));
        assert_eq!(
            "file://localhost/srv/img.raw".parse(),
            Ok(ImageUrl::File("/srv/img.raw".into()))
        );
    }

    #[test]
    fn hostile_urls_say_what_is_wrong() {
        let url = |s: &str| s.parse::<ImageUrl>().unwrap_err();
        assert_eq!(url("ftp://host/x"), RefError::Scheme("ftp".into()));
        assert_eq!(url("gopher://host/x"), RefError::Scheme("gopher".into()));
        assert_eq!(url("/etc/passwd"), RefError::Malformed("/etc/passwd".into()));
        assert_eq!(url("http://user:pw@host/x"), RefError::Credentials);
        assert_eq!(url("http:///x"), RefError::Malformed("http:///x".into()));
        assert!(matches!(url("http://host/a b"), RefError::Malformed(_)));
        assert!(matches!(url("http://host/a\r\nX-Injected: 1"), RefError::Malformed(_)));
        assert_eq!(url("file://etc/passwd"), RefError::FileNotAbsolute("etc/passwd".into()));
        assert_eq!(url("file://other-host/x"), RefError::FileNotAbsolute("other-host/x".into()));
        for path in ["/srv/../etc/shadow", "/srv/./x", "/srv/%2e%2e/x", "/srv/x\0"] {
            assert_eq!(url(&format!("file://{path}")), RefError::FilePath(path.into()), "{path:?}");
        }
        let long = format!("http://host/{}", "a".repeat(MAX_URL_LEN));
        assert_eq!(url(&long), RefError::TooLong(long.len()));
    }

    #[test]
    fn hostile_digests_say_what_is_wrong() {
        let e = ImageRef::parse("http://h/x", HEX).unwrap_err();
        assert_eq!(e, RefError::Digest(DigestError::Algorithm(HEX.into())));
        let e = ImageRef::parse("http://h/x", "sha256:xyz").unwrap_err();
        assert_eq!(e, RefError::Digest(DigestError::NotHex('x')));
    }
}
