"""ddtop.daemon: the daemon process (supervisor, relay, launchers, a multi-node job's hub
and nodes, the exporters' servers) and `ddtrain`'s command line. Never imports torch,
so `ddtrain` answers instantly; what it shares with the other sides is in ddtop.core."""
