//! A real `mlflow server` for the integration tests: sqlite store and proxied artifacts in a temp
//! dir, a free loopback port, its own process group (killed as a group when dropped).
//! The binary: $ORTRAIN_MLFLOW_BIN, else `<workspace>/.venv/bin/mlflow`; absent → the test skips.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct MlflowServer {
    pub bin: PathBuf,
    pub dir: PathBuf,
    pub port: u16,
    child: Option<Child>,
}

pub fn mlflow_bin() -> Option<PathBuf> {
    let p = std::env::var_os("ORTRAIN_MLFLOW_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/mlflow"));
    p.exists().then_some(p)
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("no free port")
}

impl MlflowServer {
    /// Starts a server, or returns None (printing why) when no mlflow binary exists.
    pub fn start(tag: &str) -> Option<Self> {
        let Some(bin) = mlflow_bin() else {
            eprintln!("SKIP: no mlflow binary (set ORTRAIN_MLFLOW_BIN or create .venv with scripts/bootstrap.sh)");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("ortrain-tracking-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut s = MlflowServer { bin, dir, port: free_port(), child: None };
        s.launch();
        Some(s)
    }

    pub fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server process on the same port and store, and waits until healthy.
    pub fn launch(&mut self) {
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(self.dir.join("server.log")).expect("log");
        let child = Command::new(&self.bin)
            .args(["server", "--host", "127.0.0.1", "--port", &self.port.to_string(), "--workers", "1"])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}/mlflow.db", self.dir.display()))
            .arg("--artifacts-destination")
            .arg(self.dir.join("artifacts"))
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .process_group(0)
            .spawn()
            .expect("spawn mlflow server");
        self.child = Some(child);
        let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(2))).build().into();
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if agent.get(&format!("{}/health", self.uri())).call().is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        panic!("mlflow server did not become healthy in 90 s; log:\n{log}");
    }

    /// Kills the whole process group (server and its workers) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill").args(["-s", "KILL", "--", &format!("-{}", c.id())]).status();
            let _ = c.wait();
            // wait until the port is free again so a restart can bind it
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && TcpListener::bind(("127.0.0.1", self.port)).is_err() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
