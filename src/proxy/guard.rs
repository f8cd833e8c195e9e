//! Which requests pare accepts, before anything else reads them: a `Host` pare answers to (a web
//! page that rebinds its own name to 127.0.0.1 is refused, so it never becomes same-origin with pare)
//! and an `Origin` pare trusts (a page on another site cannot make the browser send pare a request:
//! no cross-site POST reaches the archive or the upstream). Agents, SDKs and command-line clients
//! send no `Origin` and a loopback or configured `Host`, so they never notice the guard.

use http::header::{HOST, ORIGIN};
use http::request::Parts;
use std::borrow::Cow;

use http::{HeaderMap, HeaderValue};

/// What the guard allows beyond loopback (`server.allowed_hosts`, `server.allowed_origins`).
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// Host names (no port) accepted in `Host` besides IP literals and `localhost`; `*` accepts any.
    hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) accepted besides loopback ones; `*` accepts any.
    origins: Vec<String>,
}

/// Why the guard refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("host {host:?} is not one pare answers to (add it to server.allowed_hosts)")]
    Host { host: String },
    #[error("origin {origin:?} is not allowed to call pare (add it to server.allowed_origins)")]
    Origin { origin: String },
}

impl Guard {
    pub fn new(hosts: &[String], origins: &[String]) -> Guard {
        let lower = |items: &[String]| {
            items.iter().map(|item| item.trim().trim_end_matches('/').to_ascii_lowercase()).collect()
        };
        Guard { hosts: lower(hosts), origins: lower(origins) }
    }

    /// Accept or refuse a request by its authority (the URI's, as HTTP/2 sends it, else `Host`) and
    /// its `Origin`. A request without either is accepted (HTTP/1.0 clients, curl without a host).
    pub fn check(&self, parts: &Parts) -> Result<(), Refusal> {
        // Read in place: only a refusal copies what it names.
        let authority = match parts.uri.authority() {
            Some(authority) => Some(Cow::Borrowed(authority.as_str())),
            None => header_text(&parts.headers, HOST),
        };
        if let Some(authority) = authority
            && !self.host_allowed(&authority)
        {
            return Err(Refusal::Host { host: authority.into_owned() });
        }
        if let Some(origin) = header_text(&parts.headers, ORIGIN)
            && !self.origin_allowed(&origin)
        {
            return Err(Refusal::Origin { origin: origin.into_owned() });
        }
        Ok(())
    }

    /// A `host[:port]` pare answers to: any IP literal (a rebinding page always has a name of its
    /// own), `localhost` and its subdomains (RFC 6761: they never leave the machine), and
    /// `server.allowed_hosts`.
    fn host_allowed(&self, authority: &str) -> bool {
        let host = host_of(authority);
        if host.is_empty() {
            return false;
        }
        if is_loopback_name(host) || host.parse::<std::net::IpAddr>().is_ok() {
            return true;
        }
        self.hosts.iter().any(|allowed| allowed == "*" || allowed.eq_ignore_ascii_case(host))
    }

    /// An `Origin` pare trusts: a page served from the machine itself (a loopback IP or
    /// `localhost`) or one listed in `server.allowed_origins`. `null` (sandboxed frames, files) and
    /// every other site are refused.
    fn origin_allowed(&self, origin: &str) -> bool {
        let origin = origin.trim().trim_end_matches('/');
        if self.origins.iter().any(|allowed| allowed == "*" || allowed.eq_ignore_ascii_case(origin)) {
            return true;
        }
        let Some((scheme, authority)) = origin.split_once("://") else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
            return false;
        }
        let host = host_of(authority);
        is_loopback_name(host) || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
    }
}

/// Compare the presented token with the configured one in time independent of where they differ.
pub fn token_matches(presented: Option<&HeaderValue>, expected: &str) -> bool {
    let Some(presented) = presented else {
        return false;
    };
    let (presented, expected) = (presented.as_bytes(), expected.as_bytes());
    if presented.len() != expected.len() {
        return false;
    }
    presented.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

fn header_text(headers: &HeaderMap, name: http::header::HeaderName) -> Option<Cow<'_, str>> {
    headers.get(name).map(|value| String::from_utf8_lossy(value.as_bytes()))
}

/// The host of `host[:port]`, without the brackets of an IPv6 literal or a final dot (compared
/// without regard to ASCII case).
fn host_of(authority: &str) -> &str {
    let authority = authority.trim();
    let host = if let Some(rest) = authority.strip_prefix('[') {
        rest.split_once(']').map_or(rest, |(inside, _)| inside)
    } else {
        authority
            .rsplit_once(':')
            .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
            .map_or(authority, |(host, _)| host)
    };
    host.trim_end_matches('.')
}

fn is_loopback_name(host: &str) -> bool {
    const SUFFIX: &str = ".localhost";
    host.eq_ignore_ascii_case("localhost")
        || (host.len() > SUFFIX.len()
            && host.is_char_boundary(host.len() - SUFFIX.len())
            && host[host.len() - SUFFIX.len()..].eq_ignore_ascii_case(SUFFIX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> Parts {
        let mut builder = http::Request::builder().uri("/v1/chat/completions");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    fn refused(guard: &Guard, headers: &[(&str, &str)]) -> bool {
        guard.check(&request(headers)).is_err()
    }

    #[test]
    fn loopback_and_ip_hosts_pass_and_a_rebound_name_does_not() {
        let guard = Guard::default();
        for host in [
            "127.0.0.1:8787",
            "localhost:8787",
            "LOCALHOST",
            "[::1]:8787",
            "pare.localhost",
            "10.0.0.5:8787",
            "localhost.",
        ] {
            assert!(!refused(&guard, &[("host", host)]), "{host}");
        }
        assert!(!refused(&guard, &[]), "no host at all");
        for host in ["attacker.example:8787", "attacker.example", "127.0.0.1.nip.io", "localhost.attacker.example", ""]
        {
            assert_eq!(
                guard.check(&request(&[("host", host)])),
                Err(Refusal::Host { host: host.to_owned() }),
                "{host}"
            );
        }
    }

    #[test]
    fn allowed_hosts_add_names_and_a_star_allows_any() {
        let guard = Guard::new(&["Pare.Internal".into()], &[]);
        assert!(!refused(&guard, &[("host", "pare.internal:8787")]));
        assert!(refused(&guard, &[("host", "other.internal")]));
        assert!(!refused(&Guard::new(&["*".into()], &[]), &[("host", "other.internal")]));
    }

    #[test]
    fn the_http2_authority_is_checked_like_host() {
        let parts =
            http::Request::builder().uri("http://attacker.example:8787/v1/models").body(()).unwrap().into_parts().0;
        assert!(Guard::default().check(&parts).is_err());
        let parts = http::Request::builder().uri("http://127.0.0.1:8787/v1/models").body(()).unwrap().into_parts().0;
        assert!(Guard::default().check(&parts).is_ok());
    }

    #[test]
    fn only_loopback_or_listed_origins_pass() {
        let guard = Guard::new(&[], &["https://app.example.com/".into()]);
        let local = ("host", "127.0.0.1:8787");
        for origin in ["http://localhost:3000", "http://127.0.0.1:8787", "http://[::1]:5173", "https://app.example.com"]
        {
            assert!(!refused(&guard, &[local, ("origin", origin)]), "{origin}");
        }
        for origin in ["https://attacker.example", "null", "http://10.0.0.5", "file://", "chrome-extension://abc"] {
            assert_eq!(
                guard.check(&request(&[local, ("origin", origin)])),
                Err(Refusal::Origin { origin: origin.to_owned() }),
                "{origin}"
            );
        }
        assert!(!refused(&Guard::new(&[], &["*".into()]), &[local, ("origin", "https://attacker.example")]));
    }
}
