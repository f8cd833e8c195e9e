//! Token budget: context windows and cache-stable epochs — decides *when* and *how much* to
//! compact, and keeps forwarded prompts append-only between epochs.
//!
//! - [`window`]: the model's context window (config, upstream detection, price table, default) and answer reserve.
//! - [`price`]: what each model costs and its window (the table compiled in, `models:` prices).
//! - [`cost`]: a request's and a session's cost with pare and without it.
//! - [`compactor`]: the per-session state machine (epoch / eager / off) the proxy calls through
//!   [`crate::exchange::ConversationCompactor`].
//! - [`replay`]: a session's requests through that same path (`pare replay`, `pare eval`).
//! - [`prefill`]: the uncached prefill a prefix cache leaves a request (the proxy's estimate, `pare eval`).

pub mod compactor;
pub mod cost;
pub mod prefill;
pub mod price;
pub mod replay;
pub mod window;

pub use compactor::{CompactEngine, EpochPolicy, FrozenPlan, SessionCompactor, SessionPlan};
pub use window::{ModelTable, WindowResolver};
