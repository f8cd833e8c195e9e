//! The upstream side: where an incoming path goes (path mapping), which headers cross (hop-by-hop
//! rules, `Host`, `upstream.api_key`), and the one pooled HTTP client that carries every exchange.
//!
//! # Path mapping
//!
//! The upstream URL names the endpoint's OpenAI base, with or without its trailing `/v1`
//! (`http://h:p`, `http://h:p/v1`, `https://openrouter.ai/api/v1`). pare removes one trailing `/v1`
//! from its path to get the upstream *root*, and forwards an incoming path `P?Q` to `root + P?Q`:
//!
//! | upstream.url                 | incoming                 | forwarded to                                   |
//! |------------------------------|--------------------------|------------------------------------------------|
//! | `http://h:8080`              | `/v1/chat/completions`   | `http://h:8080/v1/chat/completions`            |
//! | `http://h:8080/v1`           | `/v1/chat/completions`   | `http://h:8080/v1/chat/completions`            |
//! | `http://h:8080/v1`           | `/props`                 | `http://h:8080/props`                          |
//! | `https://openrouter.ai/api/v1` | `/v1/models?x=1`       | `https://openrouter.ai/api/v1/models?x=1`      |
//!
//! Both spellings of the same server therefore behave identically and a path never becomes `/v1/v1`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::error::{ProxyError, cause_chain};
use crate::config::UpstreamConfig;

/// A bad `upstream.url` (refused at start).
#[derive(Debug, thiserror::Error)]
pub enum UpstreamUrlError {
    #[error("upstream url {url:?} is not a valid url: {cause}")]
    Invalid { url: String, cause: String },
    #[error("upstream url {url:?} must start with http:// or https://")]
    Scheme { url: String },
    #[error("upstream url {url:?} must not carry a query, a fragment or credentials (use upstream.api_key)")]
    Extras { url: String },
}

/// Errors building the upstream side.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error(transparent)]
    Url(#[from] UpstreamUrlError),
    #[error("upstream.api_key is not a valid header value")]
    ApiKey,
    #[error("cannot build the upstream http client: {0}")]
    Client(String),
}

/// The upstream base URL, split into what path mapping needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamBase {
    /// `scheme://host[:port]`.
    origin: String,
    /// Path prefix without a trailing `/` and without a trailing `/v1` (often empty).
    root: String,
    /// The URL as configured, for messages and `/_pare/health`.
    configured: String,
}

impl UpstreamBase {
    pub fn parse(url: &str) -> Result<UpstreamBase, UpstreamUrlError> {
        let parsed = reqwest::Url::parse(url.trim())
            .map_err(|e| UpstreamUrlError::Invalid { url: url.to_owned(), cause: e.to_string() })?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(UpstreamUrlError::Scheme { url: url.to_owned() });
        }
        if parsed.query().is_some()
            || parsed.fragment().is_some()
            || !parsed.username().is_empty()
            || parsed.password().is_some()
        {
            return Err(UpstreamUrlError::Extras { url: url.to_owned() });
        }
        let origin = parsed.origin().ascii_serialization();
        let path = parsed.path().trim_end_matches('/');
        let root = path.strip_suffix("/v1").unwrap_or(path).to_owned();
        let configured = url.trim().trim_end_matches('/').to_owned();
        Ok(UpstreamBase { origin, root, configured })
    }

    /// The upstream URL for an incoming path (starting with `/`) and optional query string.
    pub fn map(&self, path: &str, query: Option<&str>) -> String {
        let mut url =
            String::with_capacity(self.origin.len() + self.root.len() + path.len() + 1 + query.map_or(0, str::len));
        url.push_str(&self.origin);
        url.push_str(&self.root);
        if !path.starts_with('/') {
            url.push('/');
        }
        url.push_str(path);
        if let Some(query) = query {
            url.push('?');
            url.push_str(query);
        }
        url
    }

    /// The upstream as configured (without a trailing `/`), for users and logs.
    pub fn display(&self) -> &str {
        &self.configured
    }

    /// `host:port` for a reachability probe.
    pub fn authority(&self) -> Option<(String, u16)> {
        let url = reqwest::Url::parse(&self.origin).ok()?;
        Some((url.host_str()?.trim_matches(['[', ']']).to_owned(), url.port_or_known_default()?))
    }
}

/// The headers that belong to one connection, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// The header a client presents pare's inbound token in (never forwarded).
pub const PARE_TOKEN_HEADER: &str = "x-pare-token";

/// Remove hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in listed.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// The headers sent upstream for an incoming request's headers.
pub fn request_headers(incoming: &HeaderMap, api_key: Option<&HeaderValue>) -> HeaderMap {
    let mut headers = incoming.clone();
    strip_hop_by_hop(&mut headers);
    // The client sets Host from the upstream URL and Content-Length from the body it sends.
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(PARE_TOKEN_HEADER);
    // pare has read the whole body already; the upstream must not wait for a 100-continue.
    headers.remove(header::EXPECT);
    if let Some(key) = api_key {
        headers.insert(header::AUTHORIZATION, key.clone());
    }
    headers
}

/// The headers passed back to the client for an upstream response's headers.
pub fn response_headers(upstream: &HeaderMap) -> HeaderMap {
    let mut headers = upstream.clone();
    strip_hop_by_hop(&mut headers);
    headers
}

/// The upstream endpoint and the pooled client that reaches it.
pub struct Upstream {
    client: reqwest::Client,
    pub base: UpstreamBase,
    api_key: Option<HeaderValue>,
    connect_timeout: Duration,
    timeout: Duration,
    last_url: LastUrl,
}

/// The last URL sent to, parsed: an agent sends nearly every request to the same path, and parsing
/// the URL again (its host through IDNA) is a few percent of a small request's CPU.
#[derive(Debug, Default)]
struct LastUrl(std::sync::Mutex<Option<(String, reqwest::Url)>>);

impl LastUrl {
    /// `url` parsed, from the last one when it is the same; `None` when it does not parse (reqwest
    /// then reports it as it reports any bad URL).
    fn parse(&self, url: &str) -> Option<reqwest::Url> {
        let mut last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((text, parsed)) = last.as_ref()
            && text == url
        {
            return Some(parsed.clone());
        }
        let parsed = reqwest::Url::parse(url).ok()?;
        *last = Some((url.to_owned(), parsed.clone()));
        Some(parsed)
    }
}

impl Upstream {
    pub fn new(config: &UpstreamConfig) -> Result<Upstream, UpstreamError> {
        let base = UpstreamBase::parse(&config.url)?;
        let api_key = match &config.api_key {
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| UpstreamError::ApiKey)?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        // No default headers beyond an `Accept: */*` when the client sent none.
        let client = crate::outbound::client_builder(config.connect_timeout())
            .timeout(config.timeout())
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| UpstreamError::Client(cause_chain(&e)))?;
        Ok(Upstream {
            client,
            base,
            api_key,
            connect_timeout: config.connect_timeout(),
            timeout: config.timeout(),
            last_url: LastUrl::default(),
        })
    }

    /// Send one request upstream; resolves when the response headers arrive.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: HeaderMap,
        body: Option<Bytes>,
    ) -> Result<reqwest::Response, ProxyError> {
        let request = match self.last_url.parse(url) {
            Some(parsed) => self.client.request(method, parsed),
            None => self.client.request(method, url),
        };
        let mut request = request.headers(headers);
        if let Some(body) = body {
            request = request.body(body);
        }
        request.send().await.map_err(|e| self.classify(url, &e))
    }

    /// The `Authorization` value that replaces the agent's, when `upstream.api_key` is set.
    pub fn api_key(&self) -> Option<&HeaderValue> {
        self.api_key.as_ref()
    }

    fn classify(&self, url: &str, err: &reqwest::Error) -> ProxyError {
        // Never echo the query string: it may carry a key.
        let url = url.split('?').next().unwrap_or(url).to_owned();
        if err.is_timeout() {
            let secs = if err.is_connect() { self.connect_timeout } else { self.timeout }.as_secs();
            return ProxyError::UpstreamTimeout { url, secs };
        }
        // Skip reqwest's outer message: it repeats the URL with its query.
        let cause = std::error::Error::source(err).map(cause_chain).unwrap_or_else(|| "request failed".into());
        ProxyError::UpstreamUnreachable { url, cause }
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }
}

/// How long one upstream probe's outcome answers health checks.
pub const PROBE_TTL: Duration = Duration::from_secs(5);

/// The last upstream probe: health checks within [`PROBE_TTL`] of it reuse its outcome, and
/// concurrent checks wait for one probe instead of each opening a connection.
#[derive(Debug, Default)]
pub struct Probe {
    last: tokio::sync::Mutex<Option<(Instant, Result<f64, String>)>>,
}

impl Probe {
    /// Connect to `authority` unless a probe ended less than [`PROBE_TTL`] ago: `Ok` with the
    /// connect time in milliseconds, or why it failed.
    pub async fn run(&self, authority: Option<(String, u16)>, timeout: Duration) -> Result<f64, String> {
        let mut last = self.last.lock().await;
        if let Some((at, outcome)) = last.as_ref()
            && at.elapsed() < PROBE_TTL
        {
            return outcome.clone();
        }
        let started = Instant::now();
        let outcome = match authority {
            Some((host, port)) => {
                let connect = tokio::net::TcpStream::connect((host.as_str(), port));
                match tokio::time::timeout(timeout, connect).await {
                    Ok(Ok(_)) => Ok(started.elapsed().as_secs_f64() * 1e3),
                    Ok(Err(err)) => Err(err.to_string()),
                    Err(_) => Err(format!("no connection within {} ms", timeout.as_millis())),
                }
            }
            None => Err("the upstream url has no host".to_owned()),
        };
        *last = Some((Instant::now(), outcome.clone()));
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The URL of the last request is parsed once; another URL replaces it, and one that does not
    /// parse is left to reqwest.
    #[test]
    fn the_last_url_is_parsed_once_and_replaced_by_the_next() {
        let last = LastUrl::default();
        let first = "http://127.0.0.1:8080/v1/chat/completions";
        assert_eq!(last.parse(first).unwrap().as_str(), first);
        assert_eq!(last.parse(first).unwrap(), reqwest::Url::parse(first).unwrap());
        let other = "http://127.0.0.1:8080/v1/embeddings?x=1";
        assert_eq!(last.parse(other).unwrap().as_str(), other);
        assert_eq!(last.0.lock().unwrap().as_ref().unwrap().0, other);
        assert_eq!(last.parse("http://[::1/v1"), None);
        assert_eq!(last.parse(first).unwrap().as_str(), first);
    }

    fn check_map(base: &str, path: &str, query: Option<&str>, expected: &str) {
        let base = UpstreamBase::parse(base).unwrap();
        assert_eq!(base.map(path, query), expected, "{base:?} {path}");
    }

    #[test]
    fn path_mapping_never_doubles_v1() {
        check_map("http://h:8080", "/v1/chat/completions", None, "http://h:8080/v1/chat/completions");
        check_map("http://h:8080/v1", "/v1/chat/completions", None, "http://h:8080/v1/chat/completions");
        check_map("http://h:8080/v1/", "/v1/models", None, "http://h:8080/v1/models");
        check_map("http://h:8080/v1", "/props", None, "http://h:8080/props");
        check_map("http://h:8080", "/api/tags", None, "http://h:8080/api/tags");
        check_map(
            "https://openrouter.ai/api/v1",
            "/v1/models",
            Some("a=1&b=2"),
            "https://openrouter.ai/api/v1/models?a=1&b=2",
        );
        check_map("http://h/openai", "/v1/chat/completions", None, "http://h/openai/v1/chat/completions");
        check_map("http://[::1]:9000/v1", "/v1/models", None, "http://[::1]:9000/v1/models");
    }

    #[test]
    fn bad_upstream_urls_are_refused_naming_the_url() {
        for url in ["localhost:8080", "ftp://h/v1", "http://h/v1?key=1", "http://user:pw@h/v1", "not a url"] {
            let err = UpstreamBase::parse(url).unwrap_err();
            assert!(err.to_string().contains(url), "{err}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_dropped() {
        let mut headers = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-hop"),
            ("keep-alive", "timeout=5"),
            ("x-hop", "1"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic x"),
            ("proxy-connection", "keep-alive"),
            ("trailer", "x-t"),
            ("host", "127.0.0.1:8787"),
            ("content-length", "12"),
            ("authorization", "Bearer agent"),
            ("x-pare-token", "secret"),
            ("x-custom", "kept"),
        ] {
            headers.append(k, HeaderValue::from_static(v));
        }
        let forwarded = request_headers(&headers, None);
        let names: Vec<&str> = forwarded.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["authorization", "x-custom"]);
        assert_eq!(forwarded["authorization"], "Bearer agent");

        let key = HeaderValue::from_static("Bearer real");
        assert_eq!(request_headers(&headers, Some(&key))["authorization"], "Bearer real");
    }
}
