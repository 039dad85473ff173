"""Hosts per role for run.launcher=monarch: Monarch's job API (process hosts, Slurm, Kubernetes)
and where each role of the run is placed.

    roles.py     Roles: the trainer's, the generators' and the side meshes' host meshes
    jobs.py      the job per launcher.job (ProcessHosts, SlurmHosts, Kubernetes), satisfiability check
    launch.py    run_under_monarch: submit, wait for the hosts, drive the run, release the job
    worker.py    one host's Monarch worker (python -m pipeline.cluster.worker)
    manifest.py  Kubernetes: the MonarchMesh resources, and printing them without a cluster
"""
