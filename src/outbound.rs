//! How pare builds its outgoing HTTP clients (the upstream client and window detection), one way:
//! rustls with the ring provider, no redirects followed, no system proxy, no decompression (reqwest's
//! gzip/brotli features stay off).

use std::sync::Once;
use std::time::Duration;

/// Install rustls' ring provider for the process (https upstreams); safe to call any number of times.
pub fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Another part of the process may have installed one already; either way one is in place.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A client builder with pare's transparency settings and `connect_timeout`; callers add their own
/// timeouts, pool and user agent.
pub fn client_builder(connect_timeout: Duration) -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).no_proxy().connect_timeout(connect_timeout)
}
