"""ddtop.daemon: launches and supervises ranks; holds the run configuration and
run-directory layout. Never imports torch, so `ddtrain` answers instantly."""
