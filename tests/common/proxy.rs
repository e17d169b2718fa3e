//! A TCP fault proxy: forwards loopback connections to an upstream and can cut them all.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct FaultProxy {
    pub addr: SocketAddr,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    down: Arc<AtomicBool>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let down = Arc::new(AtomicBool::new(false));
        let tracked = links.clone();
        let refusing = down.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if refusing.load(Ordering::SeqCst) {
                    // The broker is "down": the connection ends before a word is said.
                    drop(client);
                    continue;
                }
                let link = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                tracked.lock().unwrap().push(link);
            }
        });
        FaultProxy {
            addr,
            links,
            down,
            accept,
        }
    }

    /// Drops every open connection (both sides see a reset/EOF); new ones still pass.
    pub fn cut(&self) -> usize {
        let mut links = self.links.lock().unwrap();
        let n = links.iter().filter(|l| !l.is_finished()).count();
        for link in links.drain(..) {
            link.abort();
        }
        n
    }
}

impl FaultProxy {
    /// A proxy in front of `authority` (`host:port`), down from the start: a service that
    /// is out of reach until [`set_down(false)`](Self::set_down).
    pub async fn down_before(authority: &str) -> FaultProxy {
        use std::net::ToSocketAddrs;
        let upstream = authority
            .to_socket_addrs()
            .expect("a host:port")
            .next()
            .expect("an address");
        let proxy = FaultProxy::start(upstream).await;
        proxy.set_down(true);
        proxy
    }

    /// Takes the "broker" down (every connection cut, new ones closed at once) or back up.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            self.cut();
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}
