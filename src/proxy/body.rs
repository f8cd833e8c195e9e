//! The response body pare streams back: the upstream's frames pass through one by one as they arrive
//! (never collected), each data chunk is shown to the request's [`ResponseSink`], and the exchange is
//! finished exactly once — at the end of the body, on an upstream error, or when the body is dropped
//! because the client went away (dropping it also drops the upstream request, which cancels it).
//!
//! An answer whose final event passed is complete however its body ends ([`ResponseSink::answer_complete`]):
//! a client that stops reading at `data: [DONE]` and closes before the upstream's last chunk did not
//! cut it.
//!
//! Finishing — the answer assembled and registered with the session tracker (a streamed answer
//! registers at its end event already), handed to the archive, the access line written and the
//! upstream's reported usage counted — happens
//! after the last byte is on its way to the client: hyper drops
//! the body before it writes that byte out, so the work runs in a task of its own. [`Finishing`]
//! keeps count of those tasks: whatever reports on ended exchanges (pare's own endpoints, the
//! shutdown before the archive closes) first waits for the ones that ended before it asked. An
//! agent's next request can arrive before its previous answer is registered; the tracker then joins
//! it to the session whose request is still waiting for its answer (`session` module docs).

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::access::AccessLog;
use super::error::cause_chain;
use crate::exchange::{ResponseSink, StreamEnd};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What runs once when an exchange ends: the archive's sink and the access log line.
pub struct Completion {
    sink: Option<Box<dyn ResponseSink>>,
    access: Option<AccessLog>,
    /// Where the end is finished in a task of its own; `None`: at once, in place.
    finishing: Option<Arc<Finishing>>,
}

impl Completion {
    /// A completion finished in place when the exchange ends.
    pub fn new(sink: Option<Box<dyn ResponseSink>>, access: AccessLog) -> Completion {
        Completion { sink, access: Some(access), finishing: None }
    }

    /// Finish the exchange in a task counted by `finishing` instead, on a multi-threaded runtime
    /// (the one `pare serve` runs; elsewhere it is finished in place).
    pub fn deferred_to(mut self, finishing: Arc<Finishing>) -> Completion {
        self.finishing = Some(finishing);
        self
    }

    /// The exchange ended: finish it, in a task when deferred. A body cut after the answer's final
    /// event (the client stopped reading there, or the upstream failed before its last chunk) ended
    /// complete: the answer is whole.
    fn end(&mut self, end: StreamEnd) {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let end = match end {
            StreamEnd::ClientGone | StreamEnd::UpstreamError(_)
                if self.sink.as_ref().is_some_and(|sink| sink.answer_complete()) =>
            {
                tracing::debug!(cut = ?end, "the body was cut after the answer's final event: complete");
                StreamEnd::Complete
            }
            end => end,
        };
        let runtime = Handle::try_current().ok().filter(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
        match (&self.finishing, runtime) {
            (Some(finishing), Some(runtime)) if self.sink.is_some() || self.access.is_some() => {
                let running = finishing.begin();
                let mut rest = Completion { sink: self.sink.take(), access: self.access.take(), finishing: None };
                runtime.spawn(async move {
                    rest.finish(end);
                    drop(running);
                });
            }
            _ => self.finish(end),
        }
    }

    fn chunk(&mut self, bytes: &Bytes) {
        if let Some(sink) = self.sink.as_mut() {
            sink.chunk(bytes);
        }
        if let Some(access) = self.access.as_mut() {
            access.bytes_out += bytes.len() as u64;
        }
    }

    /// Idempotent: only the first call has an effect.
    pub fn finish(&mut self, end: StreamEnd) {
        let answer_read = self.sink.is_some();
        let usage = self.sink.take().and_then(|sink| sink.finish_reporting(end.clone()));
        if let Some(mut access) = self.access.take() {
            access.usage = usage;
            access.answer_read = answer_read;
            access.emit(&end);
        }
    }
}

/// A streamed upstream body observed by a [`Completion`].
pub struct ObservedBody<B: Body> {
    inner: B,
    completion: Completion,
}

impl<B: Body> ObservedBody<B> {
    pub fn new(inner: B, completion: Completion) -> ObservedBody<B> {
        ObservedBody { inner, completion }
    }
}

impl<B> Body for ObservedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.completion.chunk(data);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => {
                this.completion.end(StreamEnd::UpstreamError(cause_chain(&err)));
                Poll::Ready(Some(Err(Box::new(err))))
            }
            Poll::Ready(None) => {
                this.completion.end(StreamEnd::Complete);
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B: Body> Drop for ObservedBody<B> {
    fn drop(&mut self) {
        // A body that was never polled because it was empty from the start ended normally; any
        // other body still unfinished here was dropped because the client went away.
        let end = if self.inner.is_end_stream() { StreamEnd::Complete } else { StreamEnd::ClientGone };
        self.completion.end(end);
    }
}

/// The exchanges being finished in tasks of their own (see the module docs).
#[derive(Debug, Default)]
pub struct Finishing {
    running: Mutex<Running>,
    done: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Running {
    next: u64,
    ids: BTreeSet<u64>,
}

impl Finishing {
    fn lock(&self) -> MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn begin(self: &Arc<Self>) -> Finishes {
        let mut running = self.lock();
        let id = running.next;
        running.next += 1;
        running.ids.insert(id);
        Finishes { finishing: Arc::clone(self), id }
    }

    /// Wait until every exchange that ended before this call is finished (later ones do not hold
    /// it up).
    pub async fn settled(&self) {
        let mark = self.lock().next;
        loop {
            let notified = self.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.lock().ids.first().is_none_or(|first| *first >= mark) {
                return;
            }
            notified.await;
        }
    }
}

/// One exchange being finished; dropping it (done, or its task panicked) says so.
struct Finishes {
    finishing: Arc<Finishing>,
    id: u64,
}

impl Drop for Finishes {
    fn drop(&mut self) {
        self.finishing.lock().ids.remove(&self.id);
        self.finishing.done.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use http::HeaderMap;
    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    #[derive(Default, Clone)]
    struct Recorder(Arc<Mutex<Vec<String>>>);

    impl ResponseSink for Recorder {
        fn head(&mut self, status: u16, _headers: &HeaderMap) {
            self.0.lock().unwrap().push(format!("head {status}"));
        }
        fn chunk(&mut self, bytes: &Bytes) {
            self.0.lock().unwrap().push(format!("chunk {}", String::from_utf8_lossy(bytes)));
        }
        fn finish(self: Box<Self>, end: StreamEnd) {
            self.0.lock().unwrap().push(format!("finish {end:?}"));
        }
    }

    /// A recorder that says the answer is complete once it was shown `data: [DONE]\n\n`.
    #[derive(Default, Clone)]
    struct Events {
        recorder: Recorder,
        done: bool,
    }

    impl ResponseSink for Events {
        fn head(&mut self, _status: u16, _headers: &HeaderMap) {}
        fn chunk(&mut self, bytes: &Bytes) {
            self.done |= bytes.as_ref() == b"data: [DONE]\n\n";
            self.recorder.chunk(bytes);
        }
        fn answer_complete(&self) -> bool {
            self.done
        }
        fn finish(self: Box<Self>, end: StreamEnd) {
            Box::new(self.recorder).finish(end);
        }
    }

    fn completion(recorder: &Recorder) -> Completion {
        Completion::new(
            Some(Box::new(recorder.clone())),
            AccessLog::new(http::Method::POST, "/v1/chat/completions", Instant::now()),
        )
    }

    /// A sink whose finish waits until the test lets it go (10 s at most).
    struct Gated {
        recorder: Recorder,
        gate: std::sync::mpsc::Receiver<()>,
    }

    impl ResponseSink for Gated {
        fn head(&mut self, _status: u16, _headers: &HeaderMap) {}
        fn chunk(&mut self, bytes: &Bytes) {
            self.recorder.0.lock().unwrap().push(format!("chunk {}", String::from_utf8_lossy(bytes)));
        }
        fn finish(self: Box<Self>, end: StreamEnd) {
            let _ = self.gate.recv_timeout(std::time::Duration::from_secs(10));
            self.recorder.0.lock().unwrap().push(format!("finish {end:?}"));
        }
    }

    /// A deferred end is finished in a task after the body is done, and `settled` returns once
    /// the exchanges that ended before it was called are finished, not before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deferred_end_is_finished_in_a_task_that_settled_waits_for() {
        use futures_util::FutureExt;
        let recorder = Recorder::default();
        let (open, gate) = std::sync::mpsc::channel();
        let finishing = Arc::new(Finishing::default());
        let sink = Gated { recorder: recorder.clone(), gate };
        let access = AccessLog::new(http::Method::POST, "/v1/chat/completions", Instant::now());
        let completion = Completion::new(Some(Box::new(sink)), access).deferred_to(Arc::clone(&finishing));
        let chunks = vec![Ok::<_, std::io::Error>(Frame::data(Bytes::from("a")))];
        let body = ObservedBody::new(StreamBody::new(futures_util::stream::iter(chunks)), completion);
        assert_eq!(body.collect().await.unwrap().to_bytes(), "a", "the body ends without waiting for the sink");
        assert_eq!(*recorder.0.lock().unwrap(), ["chunk a"]);
        let mut settled = Box::pin(finishing.settled());
        assert!(settled.as_mut().now_or_never().is_none(), "one exchange is still being finished");
        open.send(()).unwrap();
        settled.await;
        assert_eq!(*recorder.0.lock().unwrap(), ["chunk a", "finish Complete"]);
        finishing.settled().await;
    }

    #[tokio::test]
    async fn finishes_once_on_end_after_every_chunk() {
        let recorder = Recorder::default();
        let chunks = vec![Ok::<_, std::io::Error>(Frame::data(Bytes::from("a"))), Ok(Frame::data(Bytes::from("b")))];
        let body = ObservedBody::new(StreamBody::new(futures_util::stream::iter(chunks)), completion(&recorder));
        let collected = body.collect().await.unwrap().to_bytes();
        assert_eq!(collected, "ab");
        assert_eq!(*recorder.0.lock().unwrap(), ["chunk a", "chunk b", "finish Complete"]);
    }

    #[tokio::test]
    async fn finishes_with_the_upstream_error() {
        let recorder = Recorder::default();
        let chunks = vec![Ok(Frame::data(Bytes::from("a"))), Err(std::io::Error::other("connection reset"))];
        let body = ObservedBody::new(StreamBody::new(futures_util::stream::iter(chunks)), completion(&recorder));
        let err = body.collect().await.unwrap_err();
        assert_eq!(err.to_string(), "connection reset");
        assert_eq!(*recorder.0.lock().unwrap(), ["chunk a", "finish UpstreamError(\"connection reset\")"]);
    }

    #[test]
    fn an_empty_body_never_polled_is_complete() {
        let recorder = Recorder::default();
        drop(ObservedBody::new(http_body_util::Empty::<Bytes>::new(), completion(&recorder)));
        assert_eq!(*recorder.0.lock().unwrap(), ["finish Complete"]);
    }

    /// Regression: a client that stops reading at the final event (the openai
    /// SDK stops at `[DONE]`) and closes before the upstream's last chunk was recorded `client_gone`.
    /// The answer is whole: the exchange ends complete, in the sink and in the access line.
    #[tokio::test]
    async fn dropped_after_the_final_event_finishes_complete() {
        let events = Events::default();
        let recorder = events.recorder.clone();
        let chunks = vec![
            Ok::<_, std::io::Error>(Frame::data(Bytes::from("data: {}\n\n"))),
            Ok(Frame::data(Bytes::from("data: [DONE]\n\n"))),
            Ok(Frame::data(Bytes::from("data: late\n\n"))),
        ];
        let access = AccessLog::new(http::Method::POST, "/v1/chat/completions", Instant::now());
        let completion = Completion::new(Some(Box::new(events)), access);
        let mut body = ObservedBody::new(StreamBody::new(futures_util::stream::iter(chunks)), completion);
        for _ in 0..2 {
            body.frame().await.unwrap().unwrap();
        }
        drop(body);
        assert_eq!(recorder.0.lock().unwrap().last().unwrap(), "finish Complete");
    }

    /// The same after an upstream failure past the final event; before it, the failure stands.
    #[tokio::test]
    async fn an_upstream_error_after_the_final_event_finishes_complete() {
        for (chunks, expected) in [
            (vec!["data: {}\n\n", "data: [DONE]\n\n"], "finish Complete"),
            (vec!["data: {}\n\n"], "finish UpstreamError(\"connection reset\")"),
        ] {
            let events = Events::default();
            let recorder = events.recorder.clone();
            let mut frames: Vec<Result<Frame<Bytes>, std::io::Error>> =
                chunks.into_iter().map(|c| Ok(Frame::data(Bytes::from(c)))).collect();
            frames.push(Err(std::io::Error::other("connection reset")));
            let access = AccessLog::new(http::Method::POST, "/v1/chat/completions", Instant::now());
            let completion = Completion::new(Some(Box::new(events)), access);
            let body = ObservedBody::new(StreamBody::new(futures_util::stream::iter(frames)), completion);
            assert!(body.collect().await.is_err(), "the client still sees the upstream's error");
            assert_eq!(recorder.0.lock().unwrap().last().unwrap(), expected);
        }
    }

    #[tokio::test]
    async fn dropped_before_the_end_finishes_as_client_gone() {
        let recorder = Recorder::default();
        let chunks =
            vec![Ok::<_, std::io::Error>(Frame::data(Bytes::from("first"))), Ok(Frame::data(Bytes::from("second")))];
        let mut body = ObservedBody::new(StreamBody::new(futures_util::stream::iter(chunks)), completion(&recorder));
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "first");
        drop(body);
        assert_eq!(*recorder.0.lock().unwrap(), ["chunk first", "finish ClientGone"]);
    }
}
