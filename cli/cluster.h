/* cluster.h: `chunkserve cluster up` (cluster.c). */
#ifndef CS_CLI_CLUSTER_H
#define CS_CLI_CLUSTER_H

/* argv[1] is "cluster"; returns the process exit status. */
int cs_cli_cluster(int argc, char **argv);

#endif
