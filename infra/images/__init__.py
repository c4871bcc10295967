"""The services as container images and on Kubernetes: podman on this machine, no registry.

build.py makes the images (`python -m infra.images`) from what requirements.py picks out of the lock;
podman.py is how infra calls podman; kube.py loads and checks the manifests of k8s/
(`python -m infra.images.kube check`); container_stack.py runs the images on this machine.
"""
