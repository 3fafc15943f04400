//! The ramdisk's kernel command line: the `siteboot.*` arguments the appliance put there when it
//! served the iPXE script (`ipxe_script` in `boot/src/decision.rs`).
//!
//! | argument | value | |
//! |---|---|---|
//! | `siteboot.agent=` | `https://<IPv4 address>[:<port>]` | the agent API's base URL (required) |
//! | `siteboot.fingerprint=` | `sha256:<64 hex digits>` | the SHA-256 of the certificate served there, which the agent pins (required) |
//! | `siteboot.token=` | letters and digits | the operation's token, if the ramdisk has work |
//! | `siteboot.operation=` | letters, digits, `-`, `_`, `.` | the operation's id, with the token |
//!
//! Other arguments, `siteboot.*` ones included (`siteboot.url=`, `siteboot.mac=`), are left to
//! others: an older agent must still boot with a newer appliance. An argument given twice is an
//! error: which one the appliance meant cannot be known.
//!
//! A ramdisk booted by kexec over SSH has its secret words (`siteboot.token=`,
//! `siteboot.operation=`) in a file of its initramfs
//! ([`INITRD_CMDLINE`](siteboot_agent_api::INITRD_CMDLINE)), never on the kernel's command line
//! ([`Cmdline::parse_with_initrd`]): the two are read as one line, so an argument in both is a
//! repeat, refused as any other.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

pub use siteboot_tls_pin::Fingerprint;

/// What the appliance told this ramdisk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmdline {
    pub agent: AgentUrl,
    pub fingerprint: Fingerprint,
    pub token: Option<Token>,
    pub operation: Option<String>,
}

/// Why a command line is not one the agent can work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdlineError {
    #[error("{0} is missing")]
    Missing(&'static str),
    #[error("{0} is given more than once")]
    Repeated(&'static str),
    #[error("{argument}: {why}")]
    Invalid { argument: &'static str, why: &'static str },
}

const AGENT: &str = "siteboot.agent=";
const FINGERPRINT: &str = "siteboot.fingerprint=";
const TOKEN: &str = "siteboot.token=";
const OPERATION: &str = "siteboot.operation=";

impl Cmdline {
    /// Parses a kernel command line (`/proc/cmdline`, or the arguments of an iPXE `kernel`
    /// line): words separated by whitespace.
    pub fn parse(text: &str) -> Result<Self, CmdlineError> {
        let mut values: [Option<&str>; 4] = [None; 4];
        let names = [AGENT, FINGERPRINT, TOKEN, OPERATION];
        for word in text.split_whitespace() {
            for (name, value) in names.iter().zip(values.iter_mut()) {
                if let Some(v) = word.strip_prefix(name)
                    && value.replace(v).is_some()
                {
                    return Err(CmdlineError::Repeated(name));
                }
            }
        }
        let [agent, fingerprint, token, operation] = values;
        let invalid = |argument, why| CmdlineError::Invalid { argument, why };
        let agent = agent
            .ok_or(CmdlineError::Missing(AGENT))?
            .parse()
            .map_err(|why| invalid(AGENT, why))?;
        let fingerprint = fingerprint
            .ok_or(CmdlineError::Missing(FINGERPRINT))?
            .parse()
            .map_err(|why| invalid(FINGERPRINT, why))?;
        let token = token.map(Token::new).transpose().map_err(|why| invalid(TOKEN, why))?;
        let operation = operation
            .map(|op| {
                let ok = !op.is_empty()
                    && op.len() <= 128
                    && op.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
                if ok { Ok(op.to_owned()) } else { Err("not 1-128 of [A-Za-z0-9._-]") }
            })
            .transpose()
            .map_err(|why| invalid(OPERATION, why))?;
        Ok(Self { agent, fingerprint, token, operation })
    }

    /// The kernel's command line and the words of the initramfs's file, if it has one, parsed
    /// as one line.
    pub fn parse_with_initrd(kernel: &str, initrd: Option<&str>) -> Result<Self, CmdlineError> {
        match initrd {
            Some(words) => Self::parse(&format!("{kernel}\n{words}")),
            None => Self::parse(kernel),
        }
    }
}

/// The agent API's base URL: HTTPS to an IPv4 address (the appliance's, as DHCP gave it), no
/// path. Requests go to `<base>/agent/v1/<path>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentUrl {
    pub address: Ipv4Addr,
    pub port: u16,
}

impl FromStr for AgentUrl {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s.strip_prefix("https://").ok_or("must start with https://")?;
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (address, port) = match rest.split_once(':') {
            Some((address, port)) => (address, port.parse().map_err(|_| "bad port")?),
            None => (rest, 443),
        };
        if port == 0 {
            return Err("bad port");
        }
        let address = address.parse().map_err(|_| "must be https://<IPv4 address>[:<port>]")?;
        Ok(Self { address, port })
    }
}

impl fmt::Display for AgentUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "https://{}:{}", self.address, self.port)
    }
}

/// An operation's token: 1-128 ASCII letters and digits (siteboot mints 64 hex digits). It is
/// a secret: `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn new(s: &str) -> Result<Self, &'static str> {
        let ok = !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric());
        if ok { Ok(Self(s.to_owned())) } else { Err("not 1-128 ASCII letters and digits") }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIN: &str = "sha256:81acd762140fa692a142822d2fbe4dc6f54bcaa501f68ab37e5aeed0bafe4d99";

    fn line(extra: &str) -> String {
        format!(
            "initrd=0-initrd.img console=ttyS0 siteboot.url=http://10.0.0.1:8080 \
             siteboot.agent=https://10.0.0.1:8443 siteboot.fingerprint={PIN} \
             siteboot.mac=52-54-00-00-00-01 {extra}"
        )
    }

    #[test]
    fn a_ramdisk_command_line() {
        let c = Cmdline::parse(&line("siteboot.token=00ff siteboot.operation=op-1.a")).unwrap();
        assert_eq!(c.agent, AgentUrl { address: Ipv4Addr::new(10, 0, 0, 1), port: 8443 });
        assert_eq!(c.agent.to_string(), "https://10.0.0.1:8443");
        assert_eq!(c.fingerprint.to_string(), PIN);
        assert_eq!(c.token.as_ref().map(Token::as_str), Some("00ff"));
        assert_eq!(c.operation.as_deref(), Some("op-1.a"));
        assert_eq!(format!("{:?}", c.token.unwrap()), "Token(<redacted>)");

        let idle = Cmdline::parse(&line("\n")).unwrap();
        assert_eq!((idle.token, idle.operation), (None, None));
        let default_port = Cmdline::parse(&line("").replace(":8443", "/")).unwrap();
        assert_eq!(default_port.agent.port, 443);
    }

    /// A kexec'ed ramdisk: the public words on the kernel's line, the secret ones in the
    /// initramfs's file; a word in both is refused, whichever the value.
    #[test]
    fn the_initrd_s_words_join_the_kernel_s_and_none_may_be_in_both() {
        let secret = "siteboot.token=00ff siteboot.operation=op-1\n";
        let c = Cmdline::parse_with_initrd(&line(""), Some(secret)).unwrap();
        assert_eq!(c.token.as_ref().map(Token::as_str), Some("00ff"));
        assert_eq!(c.operation.as_deref(), Some("op-1"));
        assert_eq!(c.agent, Cmdline::parse(&line("")).unwrap().agent);
        assert_eq!(Cmdline::parse_with_initrd(&line(""), None), Cmdline::parse(&line("")));
        for (kernel, initrd, repeated) in [
            (line("siteboot.token=00ff"), secret, TOKEN),
            (line("siteboot.token=aa"), secret, TOKEN),
            (line(""), "siteboot.agent=https://10.0.0.9:8443 siteboot.token=00ff", AGENT),
        ] {
            let refused = Cmdline::parse_with_initrd(&kernel, Some(initrd));
            assert_eq!(refused, Err(CmdlineError::Repeated(repeated)), "{kernel} + {initrd}");
        }
        // The words are only the file's: a line without the kernel's required ones is refused.
        let alone = Cmdline::parse_with_initrd("console=ttyS0", Some(secret));
        assert_eq!(alone, Err(CmdlineError::Missing(AGENT)));
    }

    #[test]
    fn what_the_agent_cannot_work_with() {
        let cases: &[(String, CmdlineError)] = &[
            (
                line("").replace("siteboot.agent=https://10.0.0.1:8443", ""),
                CmdlineError::Missing(AGENT),
            ),
            (
                line("").replace(&format!("siteboot.fingerprint={PIN}"), ""),
                CmdlineError::Missing(FINGERPRINT),
            ),
            (line("siteboot.agent=https://10.0.0.2"), CmdlineError::Repeated(AGENT)),
            (line("siteboot.token=a siteboot.token=a"), CmdlineError::Repeated(TOKEN)),
        ];
        for (text, expected) in cases {
            assert_eq!(&Cmdline::parse(text).unwrap_err(), expected, "{text}");
        }
        let invalid = |text: String| match Cmdline::parse(&text) {
            Err(CmdlineError::Invalid { argument, .. }) => argument,
            other => panic!("{text}: {other:?}"),
        };
        for agent in [
            "http://10.0.0.1:8443",
            "https://appliance:8443",
            "https://10.0.0.1:0",
            "https://10.0.0.1:99999",
            "https://10.0.0.1:8443/agent",
        ] {
            let text = line("").replace("https://10.0.0.1:8443", agent);
            assert_eq!(invalid(text), AGENT, "{agent}");
        }
        for pin in [&PIN[7..], &PIN[..70], "sha1:00", &PIN.replace('8', "g")] {
            assert_eq!(invalid(line("").replace(PIN, pin)), FINGERPRINT, "{pin}");
        }
        assert_eq!(invalid(line("siteboot.token=")), TOKEN);
        assert_eq!(invalid(line("siteboot.token=a%20b")), TOKEN);
        assert_eq!(invalid(line("siteboot.operation=a/b")), OPERATION);
    }
}
