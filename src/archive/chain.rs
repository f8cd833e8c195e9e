//! The per-session hash chain: each record's hash covers its fields (body hashes included) and the
//! previous record's hash, so `verify` detects any altered, removed or reordered record.
//!
//! A record's hash is SHA-256 over a length-prefixed encoding of its fields, so no two different
//! records can encode to the same bytes. The writer and `verify` share these functions.

use sha2::{Digest, Sha256};

/// The chain starts from this hash (all zeros).
pub const GENESIS: [u8; 32] = [0; 32];

/// The hashed fields of an exchange (request) record, as stored.
#[derive(Debug, Clone)]
pub struct ExchangeFields<'a> {
    pub session: &'a str,
    pub seq: i64,
    pub chain_idx: i64,
    pub at_ms: i64,
    pub method: &'a str,
    pub path: &'a str,
    pub model: Option<&'a str>,
    pub headers: &'a str,
    pub raw_sha256: &'a [u8],
    pub raw_len: i64,
    pub fwd_sha256: Option<&'a [u8]>,
    pub fwd_len: Option<i64>,
    pub summary: Option<&'a str>,
    pub skipped: Option<&'a str>,
    pub key_req: Option<i64>,
}

/// The hashed fields of a response record, as stored.
#[derive(Debug, Clone)]
pub struct ResponseFields<'a> {
    pub session: &'a str,
    /// Sequence number of the exchange this answers.
    pub seq: i64,
    pub chain_idx: i64,
    pub at_ms: i64,
    pub status: Option<i64>,
    pub headers: &'a str,
    pub stream: bool,
    pub partial: bool,
    pub end_reason: &'a str,
    pub body_sha256: &'a [u8],
    pub body_len: i64,
    pub assembled: Option<&'a str>,
    pub key_ext: Option<i64>,
}

struct Enc(Sha256);

impl Enc {
    fn new(kind: &[u8], prev: &[u8]) -> Enc {
        let mut enc = Enc(Sha256::new());
        enc.bytes(kind);
        enc.bytes(prev);
        enc
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.update((b.len() as u64).to_le_bytes());
        self.0.update(b);
    }
    fn opt_bytes(&mut self, b: Option<&[u8]>) {
        match b {
            None => self.0.update([0u8]),
            Some(b) => {
                self.0.update([1u8]);
                self.bytes(b);
            }
        }
    }
    fn int(&mut self, v: i64) {
        self.0.update(v.to_le_bytes());
    }
    fn opt_int(&mut self, v: Option<i64>) {
        match v {
            None => self.0.update([0u8]),
            Some(v) => {
                self.0.update([1u8]);
                self.int(v);
            }
        }
    }
    fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

pub fn exchange_hash(prev: &[u8], f: &ExchangeFields<'_>) -> [u8; 32] {
    let mut e = Enc::new(b"exchange/1", prev);
    e.bytes(f.session.as_bytes());
    e.int(f.seq);
    e.int(f.chain_idx);
    e.int(f.at_ms);
    e.bytes(f.method.as_bytes());
    e.bytes(f.path.as_bytes());
    e.opt_bytes(f.model.map(str::as_bytes));
    e.bytes(f.headers.as_bytes());
    e.bytes(f.raw_sha256);
    e.int(f.raw_len);
    e.opt_bytes(f.fwd_sha256);
    e.opt_int(f.fwd_len);
    e.opt_bytes(f.summary.map(str::as_bytes));
    e.opt_bytes(f.skipped.map(str::as_bytes));
    e.opt_int(f.key_req);
    e.finish()
}

pub fn response_hash(prev: &[u8], f: &ResponseFields<'_>) -> [u8; 32] {
    let mut e = Enc::new(b"response/1", prev);
    e.bytes(f.session.as_bytes());
    e.int(f.seq);
    e.int(f.chain_idx);
    e.int(f.at_ms);
    e.opt_int(f.status);
    e.bytes(f.headers.as_bytes());
    e.int(i64::from(f.stream));
    e.int(i64::from(f.partial));
    e.bytes(f.end_reason.as_bytes());
    e.bytes(f.body_sha256);
    e.int(f.body_len);
    e.opt_bytes(f.assembled.map(str::as_bytes));
    e.opt_int(f.key_ext);
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(headers: &'a str, model: Option<&'a str>) -> ExchangeFields<'a> {
        ExchangeFields {
            session: "s",
            seq: 1,
            chain_idx: 0,
            at_ms: 5,
            method: "POST",
            path: "/v1/chat/completions",
            model,
            headers,
            raw_sha256: &[1; 32],
            raw_len: 10,
            fwd_sha256: None,
            fwd_len: None,
            summary: None,
            skipped: None,
            key_req: Some(3),
        }
    }

    #[test]
    fn every_field_and_the_previous_hash_count() {
        let base = exchange_hash(&GENESIS, &fields("{}", Some("m")));
        assert_eq!(base, exchange_hash(&GENESIS, &fields("{}", Some("m"))));
        assert_ne!(base, exchange_hash(&[1; 32], &fields("{}", Some("m"))));
        assert_ne!(base, exchange_hash(&GENESIS, &fields("{} ", Some("m"))));
        assert_ne!(base, exchange_hash(&GENESIS, &fields("{}", None)));
        // Moving bytes between adjacent fields changes the hash (length prefixes).
        assert_ne!(
            exchange_hash(&GENESIS, &fields("{}m", Some(""))),
            exchange_hash(&GENESIS, &fields("{}", Some("m")))
        );
    }
}
