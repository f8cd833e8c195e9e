//! The metrics of MISSION.md (saved, peak, prefix reuse, uncached prefill, needle recall, validity)
//! computed over replayed sessions.
