// Module and chunk ids by order of appearance rather than hashed from paths: the same sources build to the same
// bytes wherever the checkout lies (ci/lab.sh compares a fresh build with the committed one).
module.exports = {
  optimization: {
    moduleIds: 'natural',
    chunkIds: 'natural'
  }
};
