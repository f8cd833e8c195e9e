//! Which requests pare accepts, before anything else reads them: a `Host` pare answers to (a web
//! page that rebinds its own name to 127.0.0.1 is refused, so it never becomes same-origin with pare)
//! and an `Origin` pare trusts (a page on another site cannot make the browser send pare a request:
//! no cross-site POST reaches the archive or the upstream). Agents, SDKs and command-line clients
//! send no `Origin` and a loopback or configured `Host`, so they never notice the guard.
//!
//! Then which token a request needs ([`Keys`]): the owner token for pare's own endpoints and the
//! gateway (the archive is read only by whoever holds it, not by every user of the machine nor by
//! whoever reaches a load balancer in front of pare), `server.auth_token` when set for every path.
//! Only a caller on the machine itself, not forwarded by a proxy, reads `/_pare/metrics` and the
//! details of `/_pare/health` without a token.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CACHE_CONTROL, COOKIE, HOST, LOCATION, ORIGIN, REFERRER_POLICY, SET_COOKIE};
use http::request::Parts;
use http::{Method, Response, StatusCode};

use super::error::{ProxyError, Refusal};
use super::paths;
use super::token::FailedTokens;

use http::{HeaderMap, HeaderValue};

/// What the guard allows beyond loopback (`server.allowed_hosts`, `server.allowed_origins`).
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// Host names (no port) accepted in `Host` besides IP literals and `localhost`; `*` accepts any.
    hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) accepted besides loopback ones; `*` accepts any.
    origins: Vec<String>,
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

/// Which token a request needs, by its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// `/_pare/health`: answered to anyone; its details to a holder of the token or a local caller.
    Nothing,
    /// `/_pare/metrics`: counts, never content; a local caller reads it without a token.
    OwnerUnlessLocal,
    /// pare's other endpoints and the gateway endpoints: the owner token.
    Owner,
    /// The agent-facing paths: `server.auth_token` when it is set, else nothing.
    Agent,
}

/// What a request presented against what it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// It needs no token here.
    Open,
    /// It carries the right token.
    Token,
    /// It needs a token and carries none.
    Missing,
    /// It carries a token, and not the right one (answered slowly: [`super::token::FailedTokens`]).
    Wrong,
}

/// The tokens pare checks and where a request may carry them: `x-pare-token`, on the gateway
/// endpoints `Authorization: Bearer`, under `/_pare/` the cookie the UI's login sets.
#[derive(Clone)]
pub struct Keys {
    owner: String,
    /// The pace of wrong tokens, shared by every request.
    failures: Arc<FailedTokens>,
    /// `server.auth_token` is set (and is the owner token): every path but health needs it.
    everywhere: bool,
    /// The cookie's name, with the listening port in it: browsers send a host's cookies to all its
    /// ports, and two pares on one machine must not log each other out.
    cookie: String,
}

impl Keys {
    pub fn new(owner: &str, everywhere: bool, port: u16) -> Keys {
        Keys { owner: owner.to_owned(), failures: Arc::default(), everywhere, cookie: format!("pare_token_{port}") }
    }

    /// [`Keys::new`] with wrong tokens paced by `failures`.
    pub fn with_failures(mut self, failures: FailedTokens) -> Keys {
        self.failures = Arc::new(failures);
        self
    }

    /// Wrong tokens wait their turn ([`FailedTokens`]); while too many wait, every request that
    /// shows a token is refused with 429 whether it is right or not, so that the answer tells a
    /// guesser nothing.
    pub async fn pace(&self, admission: Admission) -> Result<(), ProxyError> {
        if matches!(admission, Admission::Token | Admission::Wrong) && self.failures.saturated() {
            return Err(ProxyError::TokenGuesses);
        }
        if admission == Admission::Wrong {
            self.failures.pause().await;
        }
        Ok(())
    }

    /// The UI's login, for a `GET` under `/_pare/ui/` with `?token=` (the URL pare prints at start):
    /// the right token sets the cookie and sends the browser to the same page without the token in
    /// its address (303); a wrong one is paced and refused. `None` for every other request.
    pub async fn login(&self, parts: &Parts) -> Option<Result<Response<Bytes>, ProxyError>> {
        let path = parts.uri.path();
        if parts.method != Method::GET || !(path == crate::ui::PREFIX || path.starts_with("/_pare/ui/")) {
            return None;
        }
        let pairs = crate::ui::form_urlencoded_pairs(parts.uri.query()?);
        let (_, presented) = pairs.iter().find(|(name, _)| name == "token")?;
        let admission = if self.matches(presented) { Admission::Token } else { Admission::Wrong };
        if let Err(err) = self.pace(admission).await {
            return Some(Err(err));
        }
        if admission == Admission::Wrong {
            return Some(Err(ProxyError::Unauthorized));
        }
        let rest: Vec<String> = pairs
            .iter()
            .filter(|(name, _)| name != "token")
            .map(|(name, value)| format!("{}={}", crate::ui::percent_encode(name), crate::ui::percent_encode(value)))
            .collect();
        let location = if rest.is_empty() { path.to_owned() } else { format!("{path}?{}", rest.join("&")) };
        let mut response = Response::new(Bytes::new());
        *response.status_mut() = StatusCode::SEE_OTHER;
        let headers = response.headers_mut();
        if let Ok(location) = HeaderValue::from_str(&location) {
            headers.insert(LOCATION, location);
        }
        if let Ok(cookie) = HeaderValue::from_str(&self.set_cookie()) {
            headers.insert(SET_COOKIE, cookie);
        }
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        headers.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
        Some(Ok(response))
    }

    /// Which token a request to `path` needs.
    pub fn need(path: &str) -> Need {
        if path == paths::HEALTH_PATH {
            Need::Nothing
        } else if path == paths::METRICS_PATH {
            Need::OwnerUnlessLocal
        } else if paths::is_pare_path(path) || paths::is_gateway(path) {
            Need::Owner
        } else {
            Need::Agent
        }
    }

    /// What the request in `parts` presented for what its path needs; `local`: it came from this
    /// machine and through no proxy ([`is_local`]).
    pub fn admit(&self, parts: &Parts, local: bool) -> Admission {
        match Keys::need(parts.uri.path()) {
            Need::Agent if !self.everywhere => Admission::Open,
            Need::OwnerUnlessLocal if local && !self.everywhere => Admission::Open,
            // Health is open, but a token it is shown still counts: a wrong one gets no details.
            _ => self.presented(parts),
        }
    }

    /// Whether `/_pare/health` shows its details: to a holder of the token, or to a local caller
    /// when no `server.auth_token` guards every path.
    pub fn health_details(&self, admission: Admission, local: bool) -> bool {
        admission == Admission::Token || (admission == Admission::Missing && local && !self.everywhere)
    }

    /// `Set-Cookie` for a browser that presented the token in the UI's URL: sent back on
    /// `/_pare/` only, never to scripts (`HttpOnly`) nor with requests other sites start
    /// (`SameSite=Strict`).
    pub fn set_cookie(&self) -> String {
        format!("{}={}; Path={}; HttpOnly; SameSite=Strict", self.cookie, self.owner, paths::PARE_PREFIX)
    }

    /// Whether `presented` is the owner token.
    pub fn matches(&self, presented: &str) -> bool {
        token_matches(HeaderValue::from_str(presented).ok().as_ref(), &self.owner)
    }

    fn presented(&self, parts: &Parts) -> Admission {
        let path = parts.uri.path();
        let mut shown = false;
        if let Some(value) = parts.headers.get(super::PARE_TOKEN_HEADER) {
            shown = true;
            if token_matches(Some(value), &self.owner) {
                return Admission::Token;
            }
        }
        if paths::is_gateway(path) {
            let bearers = parts.headers.get_all(AUTHORIZATION).into_iter().filter_map(|v| v.to_str().ok());
            for bearer in bearers.filter_map(|v| v.strip_prefix("Bearer ")) {
                shown = true;
                if self.matches(bearer.trim()) {
                    return Admission::Token;
                }
            }
        }
        if paths::is_pare_path(path) {
            let pairs = parts.headers.get_all(COOKIE).into_iter().filter_map(|v| v.to_str().ok());
            for (name, value) in pairs.flat_map(|v| v.split(';')).filter_map(|pair| pair.trim().split_once('=')) {
                if name == self.cookie {
                    shown = true;
                    if self.matches(value) {
                        return Admission::Token;
                    }
                }
            }
        }
        if shown { Admission::Wrong } else { Admission::Missing }
    }
}

/// The headers with which a proxy names the client it forwards for.
const FORWARDING_HEADERS: [&str; 3] = ["forwarded", "x-forwarded-for", "x-real-ip"];

/// A caller on this machine that came through no proxy: its peer address is loopback and it
/// carries none of `FORWARDING_HEADERS` (behind a load balancer on the same host every peer is
/// loopback, and the client is elsewhere). Without a peer address, not local.
pub fn is_local(peer: Option<std::net::SocketAddr>, headers: &HeaderMap) -> bool {
    peer.is_some_and(|peer| peer.ip().is_loopback()) && !FORWARDING_HEADERS.iter().any(|h| headers.contains_key(*h))
}

/// The address of the peer a request came from, put in its extensions by the server.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::SocketAddr);

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

    const OWNER: &str = "0123456789abcdef0123";

    fn to(path: &str, headers: &[(&str, &str)]) -> Parts {
        let mut builder = http::Request::builder().uri(path);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    /// Regression: without `server.auth_token` every local user, and behind a load balancer anyone
    /// who reached it, read the UI and the archive's content.
    #[test]
    fn the_archive_needs_the_owner_token_and_agent_paths_do_not() {
        let keys = Keys::new(OWNER, false, 8787);
        for path in ["/_pare/ui/", "/_pare/retrieve/pare:0123456789ab", "/_pare/mcp", "/v1/compress", "/v1/retrieve/ab"]
        {
            assert_eq!(keys.admit(&to(path, &[]), true), Admission::Missing, "{path}");
            assert_eq!(keys.admit(&to(path, &[("x-pare-token", OWNER)]), false), Admission::Token, "{path}");
            assert_eq!(keys.admit(&to(path, &[("x-pare-token", "0123456789abcdef0124")]), true), Admission::Wrong);
        }
        assert_eq!(keys.admit(&to("/v1/chat/completions", &[]), false), Admission::Open);
        assert_eq!(keys.admit(&to("/_pare/health", &[]), false), Admission::Missing);
        assert_eq!(keys.admit(&to("/_pare/metrics", &[]), true), Admission::Open);
        assert_eq!(keys.admit(&to("/_pare/metrics", &[]), false), Admission::Missing);
        let everywhere = Keys::new(OWNER, true, 8787);
        assert_eq!(everywhere.admit(&to("/v1/chat/completions", &[]), true), Admission::Missing);
        assert_eq!(everywhere.admit(&to("/_pare/metrics", &[]), true), Admission::Missing);
    }

    #[test]
    fn the_cookie_counts_under_pare_and_the_bearer_on_the_gateway() {
        let keys = Keys::new(OWNER, false, 8787);
        let cookie = format!("other=1; pare_token_8787={OWNER}");
        assert_eq!(keys.admit(&to("/_pare/ui/", &[("cookie", &cookie)]), false), Admission::Token);
        assert_eq!(keys.admit(&to("/v1/compress", &[("cookie", &cookie)]), false), Admission::Missing);
        let other_port = format!("pare_token_8788={OWNER}");
        assert_eq!(keys.admit(&to("/_pare/ui/", &[("cookie", &other_port)]), false), Admission::Missing);
        let bearer = format!("Bearer {OWNER}");
        assert_eq!(keys.admit(&to("/v1/compress", &[("authorization", &bearer)]), false), Admission::Token);
        assert_eq!(keys.admit(&to("/_pare/ui/", &[("authorization", &bearer)]), false), Admission::Missing);
        assert!(keys.set_cookie().contains("HttpOnly; SameSite=Strict"));
    }

    #[test]
    fn tokens_must_match_exactly() {
        assert!(token_matches(Some(&HeaderValue::from_static("s3cret")), "s3cret"));
        assert!(!token_matches(Some(&HeaderValue::from_static("s3cre")), "s3cret"));
        assert!(!token_matches(Some(&HeaderValue::from_static("s3creT")), "s3cret"));
        assert!(!token_matches(None, "s3cret"));
    }

    #[test]
    fn a_forwarded_request_is_never_local() {
        let loopback = Some("127.0.0.1:50000".parse().unwrap());
        assert!(is_local(loopback, &HeaderMap::new()));
        assert!(!is_local(None, &HeaderMap::new()));
        assert!(!is_local(Some("10.0.0.5:50000".parse().unwrap()), &HeaderMap::new()));
        for header in FORWARDING_HEADERS {
            let mut headers = HeaderMap::new();
            headers.insert(header, HeaderValue::from_static("203.0.113.7"));
            assert!(!is_local(loopback, &headers), "{header}");
        }
    }

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
