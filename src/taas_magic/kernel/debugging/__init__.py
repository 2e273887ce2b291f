"""In the kernel: the notebook's visual debugger on the ranks: the bridge between the front end's requests and each
rank's debugger engine, its pure router, the one thread that decides which stopped rank is shown."""
