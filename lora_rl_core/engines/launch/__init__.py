"""What a run starts for its engines: SGLang servers and Ray actors, each stopped with the run.

`command`: the `sglang.launch_server` command line; `process`: an SGLang server as a process group
(`SGLangServer`, `launch_sglang`); `sglang`: the `sglang` kind's builders (clients of given or launched
servers); `ray_replicas`: any engine kind as Ray actor replicas; `ray_sglang`: Ray actors that each own an
SGLang server.
"""
