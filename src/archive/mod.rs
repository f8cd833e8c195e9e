//! The raw archive: a durable embedded store of every chat exchange, the audit queries over it, and
//! DPO/SFT export from the raw sessions.
