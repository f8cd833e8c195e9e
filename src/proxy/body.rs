//! The response body pare streams back: the upstream's frames pass through one by one as they arrive
//! (never collected), each data chunk is shown to the request's [`ResponseSink`], and the exchange is
//! finished exactly once — at the end of the body, on an upstream error, or when the body is dropped
//! because the client went away (dropping it also drops the upstream request, which cancels it).

use std::pin::Pin;
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
}

impl Completion {
    pub fn new(sink: Option<Box<dyn ResponseSink>>, access: AccessLog) -> Completion {
        Completion { sink, access: Some(access) }
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
        if let Some(sink) = self.sink.take() {
            sink.finish(end.clone());
        }
        if let Some(access) = self.access.take() {
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
                this.completion.finish(StreamEnd::UpstreamError(cause_chain(&err)));
                Poll::Ready(Some(Err(Box::new(err))))
            }
            Poll::Ready(None) => {
                this.completion.finish(StreamEnd::Complete);
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
        self.completion.finish(end);
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

    fn completion(recorder: &Recorder) -> Completion {
        Completion::new(
            Some(Box::new(recorder.clone())),
            AccessLog::new(http::Method::POST, "/v1/chat/completions", Instant::now()),
        )
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
