//! pare running in-process on `127.0.0.1:0`, with a shutdown trigger the test controls.

use std::net::SocketAddr;
use std::sync::Arc;

use pare::config::Config;
use pare::pipeline::{ConversationCompactor, Pipeline};
use pare::proxy::ServeError;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::stub::Stub;

/// A running pare; shut it down with [`Pare::shutdown`] (dropping it aborts the server task).
pub struct Pare {
    pub addr: SocketAddr,
    pub pipeline: Arc<Pipeline>,
    trigger: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServeError>>>,
}

impl Drop for Pare {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Defaults pointed at `stub` (as `http://…/v1`), with the archive off, short grace and
/// [`super::TOKEN`] as the owner token.
pub fn config_for(stub: &Stub) -> Config {
    let mut config = Config::default();
    config.server.owner_token = Some(super::TOKEN.to_owned());
    config.upstream.url = format!("{}/v1", stub.url());
    config.archive.enabled = false;
    config.server.shutdown_grace_secs = 10;
    config
}

/// Start pare with `config` and the identity pipeline.
pub async fn start(config: Config) -> Pare {
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::identity(config.clone()));
    start_with_pipeline(config, pipeline).await
}

/// Start pare with `config` and a pipeline around `compactor`.
pub async fn start_with_compactor(config: Config, compactor: Arc<dyn ConversationCompactor>) -> Pare {
    let config = Arc::new(config);
    let pipeline = Arc::new(Pipeline::new(config.clone(), compactor));
    start_with_pipeline(config, pipeline).await
}

/// Start pare with a pipeline built by the caller (e.g. with an archive wired in).
pub async fn start_with_pipeline(config: Arc<Config>, pipeline: Arc<Pipeline>) -> Pare {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind pare");
    let addr = listener.local_addr().unwrap();
    let (trigger, triggered) = oneshot::channel::<()>();
    let shutdown = async move {
        let _ = triggered.await;
    };
    let task = tokio::spawn(pare::proxy::run(listener, config, pipeline.clone(), shutdown));
    Pare { addr, pipeline, trigger: Some(trigger), task: Some(task) }
}

impl Pare {
    /// `http://127.0.0.1:PORT` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Whether `run` is still running (serving or draining).
    pub fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|task| !task.is_finished())
    }

    /// Signal shutdown without waiting for it.
    pub fn trigger_shutdown(&mut self) {
        if let Some(trigger) = self.trigger.take() {
            let _ = trigger.send(());
        }
    }

    /// Signal shutdown and wait (bounded) until `run` returns.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        self.trigger_shutdown();
        let task = self.task.take().expect("pare task");
        super::within("pare to shut down", task).await.expect("pare task panicked")
    }
}
